"""``python -m libra ...`` → :func:`libra.cli.main`."""

import sys

from libra.cli import main

sys.exit(main())
