"""Child processes that do not outlive their parent: ``preexec_fn=die_with_parent(sig)`` asks Linux
(``prctl(PR_SET_PDEATHSIG)``) to send ``sig`` to the child when the parent dies, however it dies (SIGKILL, the
OOM killer, a test runner's timeout), so a killed ``libra run`` leaves no broker or supervisor behind and a
killed supervisor no slots. Linux only; elsewhere, or without a libc, it does nothing.

The signal is tied to the parent *thread* that started the child: a child started from a worker thread gets it
when that thread ends. Start long-lived children from the thread that outlives them.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that sets the parent-death signal to ``sig`` (None off
    Linux, where Popen then runs nothing before exec)."""
    if not sys.platform.startswith("linux"):
        return None

    def _set() -> None:  # in the child, between fork and exec: no locks, no logging
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
        except (OSError, AttributeError):
            pass

    return _set
