"""``python -m libra ...`` → :func:`libra.cli.main` (its usage lines then say ``python -m libra``)."""

import sys

from libra.cli import main

sys.exit(main(prog="python -m libra"))
