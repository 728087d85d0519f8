"""``python -m libra.bench failover``: a standby broker takes over from a killed primary (#32).

Two scenarios with real processes on loopback, one run:

1. **Failover with calls pending.** A primary broker (``--journal``, ``--replicate-bind``) and a standby
   (``--standby-of`` the primary, its own ``--journal`` and serving address, not bound while it stands by);
   CPU actors given both addresses (``--broker P,S``) and one client given both. ``--calls`` ``bash`` calls
   each append their id and start time to a ledger file outside the sandbox (``--allow-unisolated`` with
   bubblewrap hidden, as in ``bench chaos``), then sleep. Once ``--kill-after`` ids are in the ledger the
   primary is killed with SIGKILL; nothing is restarted: the standby takes over on its replicated journal
   and the actors and the client move to it by themselves. Counted as in ``bench chaos``: ``lost``,
   ``executed_twice``, ``never_ran``, ``attempts_untrue``. Timed: from the kill to the last answer, against the
   same run without a kill (the same moment, "``--kill-after`` ran", to the last answer: the baseline), and
   from the kill to the standby's first status answer (``takeover_s``, client side).
2. **The cost of the synchronous ack.** Sequential ``echo`` calls through a broker with a journal, with a
   standby attached (each pass's replies wait for its ack) vs without one, alternated over ``--rounds``; the
   p50 and p99 and their ratio. Actors run ``--no-direct`` so every call crosses the broker.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from libra.bench.chaos import _ledger, unisolated_path
from libra.bench.output import emit
from libra.client import Client
from libra.local import child_env, free_port, stop_process, wait_until

__all__ = ["echo_cost", "failover", "run"]


def _url() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _broker(url: str, log: Path, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("ab") as fh:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "info", *args],
                                stdout=fh, stderr=subprocess.STDOUT, env=child_env(env or {}))


def _pair(workdir: Path, tag: str, heartbeat_s: float, takeover_after_s: float) -> tuple[str, str, list]:
    """A primary and its standby, the standby in sync: ``(primary url, standby url, [primary, standby])``."""
    p, s, r = _url(), _url(), _url()
    hb = ["--heartbeat-s", str(heartbeat_s)]
    plog = workdir / f"{tag}-primary.log"
    procs = [_broker(p, plog, [*hb, "--journal", str(workdir / f"{tag}-p.sqlite"), "--replicate-bind", r]),
             _broker(s, workdir / f"{tag}-standby.log", [*hb, "--journal", str(workdir / f"{tag}-s.sqlite"),
                                                         "--standby-of", r, "--takeover-after-s",
                                                         str(takeover_after_s)])]
    try:
        wait_until(lambda: b"replica_in_sync" in plog.read_bytes(), 120, "the standby in sync")
    except BaseException:
        for proc in reversed(procs):
            stop_process(proc)
        raise
    return p, s, procs


def _answers(url: str, n: int, timeout: float = 120) -> None:
    def ok() -> bool:
        try:
            with Client(url, connect_timeout=2) as c:
                return len(c.status(timeout=2).actors) >= n
        except Exception:
            return False
    wait_until(ok, timeout, f"{n} actors at {url}", step=0.1)


def _stats(url: str) -> dict[str, Any]:
    with Client(url, connect_timeout=10) as c:
        return c.status(timeout=10).stats


def failover(workdir: Path, kill: bool, calls: int = 1000, kill_after: int = 300, sleep_s: float = 0.05,
             slots: int = 2, capacity: int = 8, heartbeat_s: float = 0.3,
             takeover_after_s: float = 3.0) -> dict[str, Any]:
    """Scenario 1 (module docstring), with the primary killed or (``kill=False``) not: the counts and times."""
    tag = "kill" if kill else "base"
    ledger = workdir / f"{tag}-ledger"
    ledger.write_text("")
    prim, stand, procs = _pair(workdir, tag, heartbeat_s, takeover_after_s)
    results: list[Any] = []
    answered_at: dict[int, float] = {}
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "libra.actors", "--broker", f"{prim},{stand}", "--cpu-slots", str(slots),
             "--gpu-slots", "0", "--allow-unisolated", "--capacity", str(capacity), "--log-level", "warning"],
            env=child_env({"PATH": unisolated_path(workdir)})))
        _answers(prim, slots)
        with Client([prim, stand], connect_timeout=30) as c:
            t0 = time.time()
            futs = [c.submit_tool("bash", {"command": f"echo {i} $EPOCHREALTIME >> {ledger}; sleep {sleep_s}"},
                                  timeout=900) for i in range(calls)]
            for i, f in enumerate(futs):
                f.add_done_callback(lambda _f, i=i: answered_at.setdefault(i, time.time()))
            waiter = threading.Thread(target=lambda: results.extend(c.gather(futs)), daemon=True)
            waiter.start()
            wait_until(lambda: len(_ledger(ledger)) >= kill_after, 600, f"{kill_after} calls run", step=0.01)
            t_mark = time.time()
            takeover_s = None
            if kill:
                procs[0].kill()  # SIGKILL: the primary broker is gone, nothing restarts it
                procs[0].wait()
                _answers(stand, 0, 120)
                takeover_s = time.time() - t_mark
            waiter.join(900)
            serving = stand if kill else prim
        stats = _stats(serving)
    finally:
        for proc in reversed(procs):
            stop_process(proc)
    return {**_counts(results, _ledger(ledger), calls), "kill": kill, "takeover_s": takeover_s,
            "mark_to_last_answer_s": max(answered_at.values()) - t_mark if answered_at else None,
            "first_to_last_s": max(answered_at.values()) - t0 if answered_at else None,
            "restored": stats.get("restored", 0), "adopted": stats.get("adopted", 0),
            "reattached": stats.get("duplicates", 0), "revoked_at_hello": stats.get("revoked_at_hello", 0)}


def _counts(results: list[Any], runs: list[tuple[str, float]], calls: int) -> dict[str, int]:
    counts = collections.Counter(i for i, _ in runs)
    ok = {i: r for i, r in enumerate(results) if not isinstance(r, Exception) and isinstance(r.output, dict)
          and r.output.get("exit_code") == 0}
    return {"calls": calls, "answered": len(results), "lost": calls - len(ok),
            "executed_twice": sum(1 for v in counts.values() if v > 1),
            "never_ran": sum(1 for i in range(calls) if counts[str(i)] == 0),
            "attempts_untrue": sum(1 for i, r in ok.items() if r.attempts != counts[str(i)])}


def _echo_p(url: str, n: int) -> tuple[float, float]:
    """p50 and p99 (µs) of ``n`` sequential echo calls through the broker at ``url`` (after 50 warm-up calls)."""
    with Client(url, connect_timeout=30) as c:
        for i in range(50):
            c.call_tool("echo", {"i": i}, timeout=60)
        lat = []
        for i in range(n):
            t = time.perf_counter()
            c.call_tool("echo", {"i": i}, timeout=60)
            lat.append((time.perf_counter() - t) * 1e6)
    lat.sort()
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def _echo_once(workdir: Path, standby: bool, n: int, k: int) -> tuple[float, float]:
    tag = f"echo{k}-{'standby' if standby else 'alone'}"
    if standby:
        url, _, procs = _pair(workdir, tag, 1.0, 3.0)
    else:
        url = _url()
        procs = [_broker(url, workdir / f"{tag}.log", ["--journal", str(workdir / f"{tag}.sqlite")])]
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1",
                                       "--gpu-slots", "0", "--no-sandbox", "--no-direct", "--log-level", "warning"],
                                      env=child_env({})))
        _answers(url, 1)
        return _echo_p(url, n)
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def echo_cost(workdir: Path, n: int = 500, rounds: int = 2) -> dict[str, Any]:
    """Scenario 2 (module docstring): echo p50/p99 with a standby attached vs without, alternated."""
    alone, withs = [], []
    for k in range(rounds):
        alone.append(_echo_once(workdir, False, n, k))
        withs.append(_echo_once(workdir, True, n, k))
    a50, s50 = statistics.median(p for p, _ in alone), statistics.median(p for p, _ in withs)
    a99, s99 = statistics.median(p for _, p in alone), statistics.median(p for _, p in withs)
    return {"echo_calls": n, "echo_rounds": rounds, "echo_p50_alone_us": round(a50, 1),
            "echo_p50_standby_us": round(s50, 1), "echo_p50_ratio": round(s50 / a50, 3),
            "echo_p99_alone_us": round(a99, 1), "echo_p99_standby_us": round(s99, 1),
            "echo_p99_ratio": round(s99 / a99, 3)}


def run(calls: int = 1000, kill_after: int = 300, echo_calls: int = 500, rounds: int = 2) -> dict[str, Any]:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="libra-failover-") as tmp:
        work = Path(tmp)
        base = failover(work, False, calls, kill_after)
        kill = failover(work, True, calls, kill_after)
        out = {"baseline": base, "failover": kill, **echo_cost(work, echo_calls, rounds)}
    b, k = base["mark_to_last_answer_s"], kill["mark_to_last_answer_s"]
    out["last_answer_ratio"] = round(k / b, 3) if b and k else None
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _fmt(r: dict[str, Any]) -> str:
    b, k = r["baseline"], r["failover"]
    lines = ["failover: primary SIGKILLed with calls pending, standby takes over (loopback)"]
    for name, d in (("no failure", b), ("primary killed", k)):
        lines.append(f"  {name:<15} calls={d['calls']} lost={d['lost']} executed_twice={d['executed_twice']} "
                     f"never_ran={d['never_ran']} attempts_untrue={d['attempts_untrue']} "
                     f"mark->last answer={d['mark_to_last_answer_s']:.2f}s restored={d['restored']} "
                     f"adopted={d['adopted']} reattached={d['reattached']}")
    lines.append(f"  takeover (kill -> standby answers status): {k['takeover_s']:.2f}s; "
                 f"last answer: {r['last_answer_ratio']}x the run without a failure")
    lines.append(f"  echo p50 {r['echo_p50_standby_us']:.0f} us with a standby vs {r['echo_p50_alone_us']:.0f} us "
                 f"without ({r['echo_p50_ratio']}x); p99 {r['echo_p99_standby_us']:.0f} vs "
                 f"{r['echo_p99_alone_us']:.0f} us ({r['echo_p99_ratio']}x)")
    lines.append(f"  wall {r['wall_s']}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench failover",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000, help="side-effecting calls (default %(default)s)")
    p.add_argument("--kill-after", type=int, default=300, help="kill the primary once this many ran")
    p.add_argument("--echo-calls", type=int, default=500, help="sequential echo calls per measurement")
    p.add_argument("--rounds", type=int, default=2, help="alternated echo measurements of each kind")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    r = run(a.calls, a.kill_after, a.echo_calls, a.rounds)
    emit(r, a.json, _fmt)
    bad = sum(d[k] for d in (r["baseline"], r["failover"]) for k in ("lost", "executed_twice", "attempts_untrue"))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
