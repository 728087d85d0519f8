"""``python -m libra.bench chaos``: SIGKILL the broker mid-run and count what broke.

Two scenarios with real processes on loopback, one run:

1. **Side effects across a broker restart.** A broker with ``--journal`` and two CPU actors (``bash`` tool,
   ``--allow-unisolated`` with bubblewrap hidden from the actors' ``PATH``, so a command can append to a
   file outside its sandbox). ``--calls`` calls each append their own id to a ledger file, then sleep a
   little. Once ``--kill-after`` ids are in the ledger, the broker is killed with SIGKILL and restarted on
   the same journal; the actors live on. Counted: ``lost`` (calls without a successful answer),
   ``executed_twice`` (ids in the ledger more than once), ``never_ran`` (ids not in it),
   ``attempts_gt1`` (answers that say the work was started more than once) and
   ``attempts_untrue`` (answers whose ``attempts`` is not the number of times the id is in the ledger).
   Timed after the restart (each call also writes the time it started): when both actors had re-registered
   (polling status), the first answer, and the first and last answer of the *queued* calls (those that
   first ran after the restart), from the restart and from the last actor's re-registration. Target: the
   last queued call answered within 2 s of that re-registration; ``drain_floor_s`` and
   ``drain_at_rate_before_s`` say how long running them takes at the actors' full parallelism and at the
   rate the calls ran before the kill (the same run's baseline), which no recovery can beat.
2. **Re-attachment at ``--pending`` waiting calls.** A broker with ``--journal`` and no actors holds
   ``--pending`` ``echo`` calls of one client; it is killed and restarted. Re-attachment (``recovery_s``,
   not when work runs again: scenario 1 measures that): seconds from the
   restarted broker's first answer until every call is attached to it again (each resubmitted and
   recognised: ``submitted + duplicates``), seen from the client side by polling status; the median of
   ``--rounds`` restarts. Baseline: the seconds the same calls take to reach a broker that never crashed
   (submit until all are accepted).
   Then an actor joins and every call must be answered once (``lost_pending``).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from libra.bench.output import emit
from libra.client import Client
from libra.local import LocalCluster, free_port, stop_process, wait_until

#: What the unisolated ``bash`` tool needs on ``PATH`` (bubblewrap is left out on purpose).
_TOOLS = ("bash", "sh", "timeout", "env", "cat", "echo", "sleep", "mkdir", "rm", "ls", "tail", "head", "true")


def unisolated_path(root: Path) -> str:
    """A ``PATH`` directory with the shell tools but without ``bwrap``: with ``--allow-unisolated`` the
    actors' code tools then run on the host, so a command can write a file outside its sandbox."""
    d = root / "bin-no-bwrap"
    d.mkdir(parents=True, exist_ok=True)
    for name in _TOOLS:
        src = shutil.which(name)
        if src is not None and not (d / name).exists():
            os.symlink(src, d / name)
    return str(d)


def _broker_cmd(url: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "libra.broker", "--bind", url, "--log-level", "warning", *args]


def side_effects(workdir: Path, calls: int = 500, kill_after: int = 150, heartbeat_s: float = 0.3,
                 sleep_s: float = 0.1, slots: int = 2, capacity: int = 4) -> dict[str, Any]:
    """Scenario 1 (module docstring): the counts, the broker's adoption counters and the times after the
    restart (:func:`_after_restart`)."""
    ledger = workdir / "ledger"
    ledger.write_text("")
    args = ["--heartbeat-s", str(heartbeat_s), "--journal", str(workdir / "broker.sqlite")]
    cluster = LocalCluster(cpu_slots=slots, port=free_port(), broker_args=args,
                           actor_args=["--allow-unisolated", "--capacity", str(capacity)],
                           env={"PATH": unisolated_path(workdir)})
    cluster.start(timeout=120)
    restarted: subprocess.Popen | None = None
    results: list[Any] = []
    answered_at: dict[int, float] = {}  # call -> wall-clock time of its answer
    t_kill = t_restart = t_back = float("nan")
    try:
        with Client(cluster.url, connect_timeout=30) as c:
            # each call writes its id and the wall-clock time it started ($EPOCHREALTIME: no extra process)
            futs = [c.submit_tool("bash", {"command": f"echo {i} $EPOCHREALTIME >> {ledger}; sleep {sleep_s}"},
                                  timeout=600) for i in range(calls)]
            for i, f in enumerate(futs):
                f.add_done_callback(lambda _f, i=i: answered_at.setdefault(i, time.time()))
            waiter = threading.Thread(target=lambda: results.extend(c.gather(futs)), daemon=True)
            waiter.start()
            wait_until(lambda: len(_ledger(ledger)) >= kill_after, 300, f"{kill_after} calls run")
            assert cluster.broker is not None
            t_kill = time.time()
            cluster.broker.send_signal(signal.SIGKILL)
            cluster.broker.wait()
            at_kill = len(_ledger(ledger))
            time.sleep(0.5)
            t_restart = time.time()
            restarted = subprocess.Popen(_broker_cmd(cluster.url, args), env=cluster._env())
            t_back = _actors_back(cluster.url, slots)
            waiter.join(900)
        stats = cluster.status(timeout=10).stats
    finally:
        stop_process(restarted)
        cluster.broker = None
        cluster.stop()
    runs = _ledger(ledger)
    return {
        **count_runs(results, runs, calls), "ran_before_kill": at_kill, "restored": stats.get("restored", 0), "adopted": stats.get("adopted", 0),
        "revoked_at_hello": stats.get("revoked_at_hello", 0),
        **_after_restart(runs, answered_at, (t_kill, t_restart, t_back), sleep_s / (slots * capacity)),
    }


def count_runs(results: list[Any], runs: list[tuple[str, float]], calls: int) -> dict[str, Any]:
    """The counts of a side-effecting run: ``results[i]`` is call ``i``'s answer (a result or an exception),
    ``runs`` the ledger (:func:`_ledger`). ``lost``: calls without a successful answer (``exit_code`` 0)."""
    counts = collections.Counter(i for i, _ in runs)
    ok: dict[int, Any] = {}
    for i, r in enumerate(results):
        if not isinstance(r, Exception) and isinstance(r.output, dict) and r.output.get("exit_code") == 0:
            ok[i] = r
    return {
        "calls": calls, "answered": len(results), "lost": calls - len(ok),
        "executed_twice": sum(1 for v in counts.values() if v > 1),
        "never_ran": sum(1 for i in range(calls) if counts[str(i)] == 0),
        "attempts_gt1": sum(1 for r in ok.values() if r.attempts > 1),
        "attempts_untrue": sum(1 for i, r in ok.items() if r.attempts != counts[str(i)]),
    }


def _ledger(path: Path) -> list[tuple[str, float]]:
    """The ledger's complete lines: (call id, wall-clock time it started)."""
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append((parts[0], float(parts[1].replace(",", "."))))
    return out


def _actors_back(url: str, n: int) -> float:
    """Poll the restarted broker until ``n`` actors are registered; the wall-clock time it first saw them
    (to within one poll, 20 ms, plus a status round trip)."""
    with Client(url, connect_timeout=60) as c:
        while len(c.status(timeout=30).actors) < n:
            time.sleep(0.02)
        return time.time()


def _after_restart(runs: list[tuple[str, float]], answered_at: dict[int, float],
                   times: tuple[float, float, float], per_call_floor_s: float) -> dict[str, Any]:
    """When work ran and was answered again after the broker restart. The *queued* calls are those whose
    only run started after the restart (none of them was running on an actor when the broker died): seconds
    from the restart (spawn of the new broker) and from the last actor's re-registration to their first and
    last answer, and to the first of them starting. ``drain_floor_s``: the seconds the queued calls need at
    the actors' full parallelism (their count x the sleep / (slots x capacity)), a lower bound on the last
    answer that no recovery can beat; ``drain_at_rate_before_s``: the same at the rate the calls started
    before the kill (measured in this run: process starts included), the baseline for the last answer."""
    t_kill, t_restart, t_back = times
    before = sorted(t for _, t in runs if t < t_kill)
    rate = (len(before) - 1) / (before[-1] - before[0]) if len(before) > 1 and before[-1] > before[0] else None
    queued = {int(i) for i, t in runs if t > t_restart}
    after = [t for i, t in answered_at.items() if t > t_restart]
    q_ans = [answered_at[i] for i in queued if i in answered_at]
    q_start = [t for i, t in runs if t > t_restart]

    def rel(ts: list[float], t0: float, f: Any) -> float | None:
        return round(f(ts) - t0, 3) if ts else None

    return {
        "actors_back_s": round(t_back - t_restart, 3), "queued_after_restart": len(queued),
        "first_answer_s": rel(after, t_restart, min),
        "queued_first_answer_s": rel(q_ans, t_restart, min), "queued_last_answer_s": rel(q_ans, t_restart, max),
        "queued_first_start_after_actors_s": rel(q_start, t_back, min),
        "queued_first_answer_after_actors_s": rel(q_ans, t_back, min),
        "queued_last_answer_after_actors_s": rel(q_ans, t_back, max),
        "drain_floor_s": round(len(queued) * per_call_floor_s, 3),
        "rate_before_kill_per_s": round(rate, 1) if rate else None,
        "drain_at_rate_before_s": round(len(queued) / rate, 3) if rate else None,
    }


def _known(url: str) -> dict[str, Any]:
    with Client(url, connect_timeout=2) as c:
        return c.status(timeout=2).stats


def recovery(workdir: Path, pending: int = 1000, heartbeat_s: float = 0.5, rounds: int = 3) -> dict[str, Any]:
    """Scenario 2 (module docstring): baseline and recovery seconds (median and worst of ``rounds`` kills),
    and the calls lost."""
    url = f"tcp://127.0.0.1:{free_port()}"
    args = ["--heartbeat-s", str(heartbeat_s), "--journal", str(workdir / "pending.sqlite")]
    procs = [subprocess.Popen(_broker_cmd(url, args))]
    results: list[Any] = []
    try:
        wait_until(lambda: _known(url) is not None, 60, "the broker")
        with Client(url, connect_timeout=30) as c:
            t0 = time.monotonic()
            futs = [c.submit_tool("echo", {"i": i}, timeout=600) for i in range(pending)]
            waiter = threading.Thread(target=lambda: results.extend(c.gather(futs)), daemon=True)
            waiter.start()
            wait_until(lambda: _known(url)["submitted"] >= pending, 120, "the calls accepted", step=0.01)
            baseline = time.monotonic() - t0
            st: dict[str, Any] = {}

            def attached() -> bool:
                st.clear()
                st.update(_known(url))
                return st.get("submitted", 0) + st.get("duplicates", 0) >= pending

            recovered, startup = [], []
            for _ in range(rounds):
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait()
                t_spawn = time.monotonic()
                procs[0] = subprocess.Popen(_broker_cmd(url, args))
                wait_until(lambda: _known(url) is not None, 60, "the restarted broker", step=0.01)
                t1 = time.monotonic()
                wait_until(attached, 300, "the calls attached again", step=0.01)
                recovered.append(time.monotonic() - t1)
                startup.append(t1 - t_spawn)
            procs.append(subprocess.Popen([sys.executable, "-m", "libra.actors", "--broker", url, "--cpu-slots", "1",
                                           "--gpu-slots", "0", "--no-sandbox", "--capacity", "64",
                                           "--log-level", "warning"]))
            waiter.join(600)
    finally:
        for p in reversed(procs):
            stop_process(p)
    right = sum(1 for i, r in enumerate(results) if not isinstance(r, Exception) and r.output == {"i": i})
    med = sorted(recovered)[len(recovered) // 2]
    return {"pending": pending, "baseline_s": baseline, "recovery_s": med, "recovery_max_s": max(recovered),
            "recovery_rounds": recovered, "recovery_over_baseline": med / baseline if baseline > 0 else None,
            "broker_start_s": sorted(startup)[len(startup) // 2],
            "restored_pending": st.get("restored", 0), "resubmitted_new": st.get("submitted", 0),
            "reattached": st.get("duplicates", 0), "lost_pending": pending - right}


def run(calls: int = 500, kill_after: int = 150, pending: int = 1000, rounds: int = 3) -> dict[str, Any]:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="libra-chaos-") as tmp:
        out = {**side_effects(Path(tmp), calls, kill_after), **recovery(Path(tmp), pending, rounds=rounds)}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _fmt(r: dict[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    return "\n".join([
        f"broker SIGKILL + restart (journal) with {r['calls']} side-effecting bash calls, actors alive:",
        f"  calls {r['calls']}  lost {r['lost']}  executed twice {r['executed_twice']}  never ran {r['never_ran']}"
        f"  attempts>1 {r['attempts_gt1']}  attempts untrue {r['attempts_untrue']}",
        f"  ran before the kill {r['ran_before_kill']}, restored from the journal {r['restored']}, adopted by "
        f"surviving actors {r['adopted']}, revoked at hello {r['revoked_at_hello']}",
        f"  after the restart: both actors re-registered at {s(r['actors_back_s'])}; first answer at "
        f"{s(r['first_answer_s'])}; the {r['queued_after_restart']} queued calls (not running when the broker "
        f"died) answered from {s(r['queued_first_answer_s'])} to {s(r['queued_last_answer_s'])}",
        f"  from the last actor's re-registration: first queued call started {s(r['queued_first_start_after_actors_s'])}"
        f" later, first answered {s(r['queued_first_answer_after_actors_s'])}, last answered "
        f"{s(r['queued_last_answer_after_actors_s'])} (target 2 s); running them takes {s(r['drain_floor_s'])} "
        f"at the actors' full parallelism, {s(r['drain_at_rate_before_s'])} at the rate calls started before the "
        f"kill ({r['rate_before_kill_per_s']}/s)",
        f"re-attachment at {r['pending']} pending calls (no actor; not when work runs again): {r['recovery_s']:.3f} s "
        f"(median of {len(r['recovery_rounds'])} restarts, worst {r['recovery_max_s']:.3f} s) from the restarted "
        f"broker's first answer until all are attached again (last restart: restored {r['restored_pending']}, "
        f"re-attached {r['reattached']}, new {r['resubmitted_new']})",
        f"  baseline (the same calls reaching a broker that never crashed): {r['baseline_s']:.3f} s; "
        f"ratio {r['recovery_over_baseline']:.2f}x; lost after the restart {r['lost_pending']}",
        f"  (the restarted process took {r['broker_start_s']:.3f} s from spawn to its first answer, journal "
        "load included; the clients' resubmissions wait in their sockets meanwhile)",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=500, help="side-effecting calls (default %(default)s)")
    p.add_argument("--kill-after", type=int, default=150, help="kill the broker once this many ran")
    p.add_argument("--pending", type=int, default=1000, help="waiting calls at the second restart")
    p.add_argument("--rounds", type=int, default=3, help="broker restarts with the pending calls waiting")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    r = run(a.calls, a.kill_after, a.pending, a.rounds)
    emit(r, a.json, _fmt)
    bad = r["lost"] + r["executed_twice"] + r["attempts_untrue"] + r["lost_pending"]
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
