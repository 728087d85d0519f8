"""A uvicorn server whose clean shutdown on SIGTERM is a clean exit.

uvicorn catches SIGINT/SIGTERM, shuts down gracefully, then raises the caught signal again with the original
handler back, so the process still dies "by the signal": under SIGTERM that is exit status -15 (143 in a
shell), which systemd and Kubernetes count as a failure. :func:`clean_sigterm_server` returns a subclass of
uvicorn's ``Server`` that forgets a caught SIGTERM once the shutdown is over: the command returns normally
(exit 0). A caught SIGINT is still raised again (``KeyboardInterrupt``, which the ``libra dashboard`` and
``libra serve`` commands turn into exit 0 themselves). Used by both commands (``libra.dashboard.__main__``,
``libra.serve.server``).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

__all__ = ["clean_sigterm_server"]


def clean_sigterm_server(base: Any) -> Any:
    """A subclass of ``base`` (``uvicorn.Server``) that does not re-raise a SIGTERM it shut down for."""

    class CleanSigtermServer(base):  # type: ignore[misc,valid-type]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:  # read by uvicorn right after this block: what it raises again
                    caught = getattr(self, "_captured_signals", None)
                    if isinstance(caught, list):
                        caught[:] = [s for s in caught if s != signal.SIGTERM]

    return CleanSigtermServer
