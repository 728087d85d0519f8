"""CPU seconds of a loopback cluster's processes during a job, for ``python -m libra bench job``.

:class:`CpuSampler` reads, every ``every_s`` on a thread, the CPU seconds (user + system, and those of exited
children) of every descendant of this process that is an actor slot (``libra.actors.runtime --slot S --role
R``: named ``S:R``) or the broker (``broker``). :func:`window_cpu` gives each name's CPU seconds within a window
of the job (its steps, on the ``time.time()`` clock), from the samples on either side: a process that started
inside the window counts from zero, one restarted counts each process. A slot's **CPU share** is its CPU
seconds over the window's length: on a host with fewer cores than processes a slot can be runnable and still
get no CPU, so a low share is "idle or starved", and the host share (all CPU seconds over cores x window) says
which.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any

__all__ = ["CpuSampler", "process_name", "window_cpu"]


def process_name(cmdline: list[str]) -> str | None:
    """``slot:role`` of an actor slot's command line, ``broker`` of the broker's, None for any other."""
    line = " ".join(cmdline)
    if "libra.actors.runtime" in line:
        def arg(flag: str, default: str) -> str:
            return cmdline[cmdline.index(flag) + 1] if flag in cmdline[:-1] else default

        return f"{arg('--slot', '?')}:{arg('--role', 'action')}"
    if "libra.broker" in line:
        return "broker"
    return None


def _cpu_at(series: list[tuple[float, float]], t: float) -> float:
    """The CPU seconds of one process at ``t``, linear between samples; 0 before its first, its last after."""
    times = [s[0] for s in series]
    i = bisect.bisect_right(times, t)
    if i == 0:
        return 0.0
    if i == len(series):
        return series[-1][1]
    (t0, c0), (t1, c1) = series[i - 1], series[i]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1


def window_cpu(samples: dict[int, list[tuple[float, float]]], names: dict[int, str], t0: float,
               t1: float) -> dict[str, float]:
    """Each name's CPU seconds within ``[t0, t1]`` from ``samples`` (pid -> ``[(time, cpu_s)]``, in time order)
    and ``names`` (pid -> name), summed over the processes of one name."""
    out: dict[str, float] = {}
    for pid, series in samples.items():
        if series and pid in names:
            out[names[pid]] = out.get(names[pid], 0.0) + max(0.0, _cpu_at(series, t1) - _cpu_at(series, t0))
    return out


class CpuSampler:
    """Samples the CPU seconds of this process's actor-slot and broker descendants (see the module docstring)."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.samples: dict[int, list[tuple[float, float]]] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-job-cpu", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            for p in me.children(recursive=True):
                try:
                    if p.pid not in self.names:
                        name = process_name(p.cmdline())
                        if name is None:
                            continue
                        self.names[p.pid] = name
                    c = p.cpu_times()
                    total = c.user + c.system + c.children_user + c.children_system
                except (psutil.Error, OSError):
                    continue
                self.samples.setdefault(p.pid, []).append((time.time(), total))
            self._stop.wait(self.every_s)
