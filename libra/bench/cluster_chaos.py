"""``python -m libra.bench cluster_chaos``: the side-effect chaos run on a real local cluster of many slots.

One broker with ``--journal`` and ``--supervisors`` real supervisors (``python -m libra.actors``, each with
``--slots`` CPU action slots and its own ``--actor-id-prefix``) on loopback: 8 x 8 = 64 slot processes by
default. The slots are the real runtime with the ``bash`` tool in unisolated mode (``--allow-unisolated``, and
bubblewrap hidden from their ``PATH`` as in :mod:`libra.bench.chaos`, so a command can append to a ledger file
outside a sandbox; this is also the lightest slot that runs the real runtime and its sandbox pool).

``--calls`` side-effecting calls are submitted at once from ``--clients`` real clients; each appends its id
and start time to the ledger (and the pids of its process's ancestors to a second file), then sleeps. At set
points of the ledger's count (``--points``, fractions of the calls), with SIGKILL:

a. ``--kill-slots`` slot processes of different supervisors (their supervisors restart them);
b. one whole supervisor with its slots (a lost host; it is not restarted), once the slots of (a) are back;
c. the broker, once it has seen the host of (b) lost; it is restarted on its journal.

Counted as :func:`libra.bench.chaos.count_runs` does (``lost``: calls without a successful answer;
``executed_twice``: ids in the ledger more than once; ``attempts_untrue``: answers whose ``attempts`` is not the
ledger's count), plus ``never_answered``, ``failed`` (a typed error), ``wrong`` (a result with a non-zero exit)
and the split of ``executed_twice``: a call whose slot was SIGKILLed while it ran is run again on purpose
(the broker cannot know how far it got; ``attempts`` says so), so ``twice_after_kill`` counts the ids whose
extra runs were all on killed processes and ``twice_unexplained`` the others (the at-most-once breaches).
Timed: the last answer from the first submit, and the floor ``calls x sleep / (slots x capacity)``.
The baseline in the same run: :func:`libra.bench.chaos.side_effects` at its default size (2 slots, broker
killed once), printed beside it.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.bench import chaos
from libra.bench.output import emit
from libra.client import Client
from libra.local import child_env, free_port, stop_process, wait_until

_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
_STATS = ("completed", "requeued", "actors_expired", "leases_lost", "stale_results", "handbacks", "timeouts",
          "restored", "adopted", "revoked_at_hello")


@dataclass
class _Cluster:
    """The processes of one run and what was killed."""

    url: str
    broker_args: list[str]
    env: dict[str, str]
    supervisors: int
    slots: int
    broker: subprocess.Popen | None = None
    sups: list[subprocess.Popen] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)  # pids SIGKILLed (slots and the supervisor)
    events: dict[str, Any] = field(default_factory=dict)

    def start_broker(self) -> None:
        self.broker = subprocess.Popen(chaos._broker_cmd(self.url, self.broker_args), env=self.env)

    def start(self, capacity: int) -> None:
        self.start_broker()
        for k in range(self.supervisors):
            self.sups.append(subprocess.Popen(
                [sys.executable, "-m", "libra.actors", "--broker", self.url, "--cpu-slots", str(self.slots),
                 "--gpu-slots", "0", "--allow-unisolated", "--capacity", str(capacity),
                 "--actor-id-prefix", f"s{k}", "--log-level", "error"], env=self.env))

    def stats(self) -> dict[str, int]:
        """The broker's counters that say whether live actors were taken for lost (work run again)."""
        with Client(self.url, connect_timeout=60) as c:
            st = c.status(timeout=30).stats
        return {k: st.get(k, 0) for k in _STATS}

    def actors(self) -> dict[str, int]:
        """The registered actors: id -> pid."""
        with Client(self.url, connect_timeout=60) as c:
            return {a["id"]: a["pid"] for a in c.status(timeout=30).actors}

    def stop(self) -> None:
        for p in reversed(self.sups):
            stop_process(p)
        stop_process(self.broker)


def tree_rss_mb(root: int) -> tuple[float, int]:
    """Resident memory (MB) of ``root``'s descendants (not ``root`` itself), and their count, from ``/proc``."""
    parent: dict[int, int] = {}
    rss: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            rss[int(d.name)] = int((d / "statm").read_text().split()[1]) * _PAGE_KB
        except (OSError, ValueError, IndexError):
            continue
        parent[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for pid, pp in parent.items():
        kids[pp].append(pid)
    todo, seen = list(kids[root]), []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(kids[pid])
    return sum(rss.get(p, 0) for p in seen) / 1024, len(seen)


def _say(what: str) -> None:
    """Progress on stderr (a run of 64 slots on a small host takes minutes)."""
    print(f"[cluster_chaos {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def _kill(pids: list[int], killed: set[int]) -> None:
    for pid in pids:
        killed.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _chaos(cl: _Cluster, ledger: Path, calls: int, points: tuple[float, float, float], kill_slots: int,
           kill_broker: bool) -> None:
    """The kills (module docstring), each once the ledger holds its point's share of the calls."""
    total = cl.supervisors * cl.slots
    ran = lambda: len(chaos._ledger(ledger))  # noqa: E731
    wait_until(lambda: ran() >= points[0] * calls, 900, "the slot-kill point")
    victims = [f"/s{k % (cl.supervisors - 1) + 1}-cpu{k // (cl.supervisors - 1)}" for k in range(kill_slots)]
    pids: list[int] = []

    def registered() -> bool:  # a slot the broker took for lost (a starved heartbeat) may be reconnecting
        pids[:] = [pid for aid, pid in cl.actors().items() if any(aid.endswith(v) for v in victims)]
        return len(pids) == kill_slots

    wait_until(registered, 300, f"the slots {victims} registered")
    cl.events.update(slots_killed=len(pids), ran_at_slot_kill=ran(), t_slot_kill=time.time())
    _say(f"SIGKILL {len(pids)} slots at {ran()} runs")
    _kill(pids, cl.killed)
    wait_until(lambda: len(set(cl.actors().values()) - cl.killed) >= total, 300, "the killed slots back")
    cl.events["t_slots_back"] = time.time()
    _say("the killed slots are back")
    wait_until(lambda: ran() >= points[1] * calls, 900, "the supervisor-kill point")
    host = [pid for aid, pid in cl.actors().items() if "/s0-" in aid]
    cl.events.update(ran_at_supervisor_kill=ran(), t_supervisor_kill=time.time())
    _say(f"SIGKILL supervisor s0 and its {len(host)} slots at {ran()} runs")
    _kill([cl.sups[0].pid, *host], cl.killed)
    cl.sups[0].wait()
    wait_until(lambda: len(cl.actors()) <= total - cl.slots, 300, "the lost host's slots dropped")
    cl.events["t_host_dropped"] = time.time()
    _say("the broker dropped the lost host's slots")
    if not kill_broker:
        return
    cl.events["broker_stats_before_kill"] = cl.stats()
    wait_until(lambda: ran() >= points[2] * calls, 900, "the broker-kill point")
    assert cl.broker is not None
    cl.events.update(ran_at_broker_kill=ran(), t_broker_kill=time.time())
    _say(f"SIGKILL the broker at {ran()} runs")
    cl.broker.send_signal(signal.SIGKILL)
    cl.broker.wait()
    time.sleep(0.5)
    cl.events["t_broker_restart"] = time.time()
    cl.start_broker()
    cl.events["t_actors_back"] = chaos._actors_back(cl.url, total - cl.slots)
    _say("the slots re-registered with the restarted broker")


def _submit(url: str, ledger: Path, who: Path, calls: int, clients: int, sleep_s: float,
            answered_at: dict[int, float]) -> tuple[list[Client], list[Future]]:
    """``calls`` bash calls from ``clients`` clients (round robin), all submitted at once, and one thread per
    client that gathers its answers (a sync client does its I/O while a caller waits). Each call writes the
    pids of its shell's five nearest ancestors to ``who`` (bash builtins only: /proc/PID/stat's 4th field),
    then its id and start time to ``ledger``."""
    cs = [Client(url, connect_timeout=60) for _ in range(clients)]
    chain = "p=$$; c=; for k in 1 2 3 4 5; do read -r _ _ _ p _ < /proc/$p/stat; c=$c.$p; done"
    futs: list[Future] = []
    for i in range(calls):
        cmd = f"{chain}; echo {i} $c >> {who}; echo {i} $EPOCHREALTIME >> {ledger}; sleep {sleep_s}"
        f = cs[i % clients].submit_tool("bash", {"command": cmd}, timeout=1800)
        f.add_done_callback(lambda _f, i=i: answered_at.setdefault(i, time.time()))
        futs.append(f)
    for k, c in enumerate(cs):
        threading.Thread(target=c.gather, args=(futs[k::clients],), daemon=True).start()
    return cs, futs


class NeverAnswered(Exception):
    """The outcome of a call that had no answer when the run ended."""


def _outcome(f: Future) -> Any:
    if not f.done():
        return NeverAnswered()
    exc = f.exception()
    return exc if exc is not None else f.result()


def _split_twice(runs: list[tuple[str, float]], who: Path, killed: set[int]) -> dict[str, int]:
    """``executed_twice`` split: extra runs all on killed processes (an ancestor pid was SIGKILLed) or not."""
    counts = collections.Counter(i for i, _ in runs)
    on_killed: collections.Counter[str] = collections.Counter()
    for line in who.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and any(int(p) in killed for p in parts[1].split(".") if p.isdigit()):
            on_killed[parts[0]] += 1
    twice = [i for i, n in counts.items() if n > 1]
    unexplained = sum(1 for i in twice if counts[i] - on_killed[i] > 1)
    return {"twice_after_kill": len(twice) - unexplained, "twice_unexplained": unexplained,
            "runs_on_killed": sum(on_killed.values())}


def _started(runs: list[tuple[str, float]], call: int, t0: float) -> list[float]:
    return [round(t - t0, 3) for i, t in runs if i == str(call)]


def cluster_run(workdir: Path, supervisors: int = 8, slots: int = 8, calls: int = 1000, capacity: int = 2,
                sleep_s: float = 3.0, clients: int = 4, kill_slots: int = 4,
                points: tuple[float, float, float] = (0.15, 0.35, 0.55), kill_broker: bool = True,
                heartbeat_s: float = 1.0, start_timeout_s: float = 900) -> dict[str, Any]:
    """One cluster run (module docstring): the counts, the kills' points and times, memory."""
    if supervisors < 2 or not 0 < kill_slots <= (supervisors - 1) * slots:
        raise ValueError(f"cluster_chaos: needs >= 2 supervisors and 1..{(supervisors - 1) * slots} slot kills "
                         f"(got supervisors={supervisors}, kill_slots={kill_slots})")
    ledger, who = workdir / "ledger", workdir / "who"
    ledger.write_text("")
    who.write_text("")
    env = child_env({"PATH": chaos.unisolated_path(workdir)})
    cl = _Cluster(f"tcp://127.0.0.1:{free_port()}", ["--heartbeat-s", str(heartbeat_s), "--journal",
                  str(workdir / "broker.sqlite")], env, supervisors, slots)
    answered_at: dict[int, float] = {}
    cs: list[Client] = []
    try:
        t_start = time.time()
        cl.start(capacity)
        wait_until(lambda: len(cl.actors()) >= supervisors * slots, start_timeout_s, "every slot registered", 1.0)
        t_up = time.time()
        _say(f"{supervisors * slots} slots registered in {t_up - t_start:.1f} s; submitting {calls} calls")
        mem = [tree_rss_mb(p.pid) for p in cl.sups]
        t0 = time.time()
        cs, futs = _submit(cl.url, ledger, who, calls, clients, sleep_s, answered_at)
        _chaos(cl, ledger, calls, points, kill_slots, kill_broker)
        _say("waiting for every answer")
        wait_until(lambda: all(f.done() for f in futs), 1800, "every call answered", 0.2)
        cl.events["broker_stats_end"] = cl.stats()
    finally:
        for c in cs:
            c.close()
        cl.stop()
    results = [_outcome(f) for f in futs]
    runs = chaos._ledger(ledger)
    counts = collections.Counter(i for i, _ in runs)
    out = {**chaos.count_runs(results, runs, calls), **_split_twice(runs, who, cl.killed)}
    out.update(answered=sum(1 for f in futs if f.done()), never_answered=sum(1 for f in futs if not f.done()),
               failed=sum(1 for r in results if isinstance(r, Exception) and not isinstance(r, NeverAnswered)),
               wrong=sum(1 for r in results if not isinstance(r, Exception)
                         and not (isinstance(r.output, dict) and r.output.get("exit_code") == 0)),
               attempts_gt1_ran_once=sum(1 for i, r in enumerate(results) if not isinstance(r, Exception)
                                         and r.attempts > 1 and counts[str(i)] == 1))
    untrue = [(i, r.attempts, counts[str(i)]) for i, r in enumerate(results)
              if not isinstance(r, Exception) and r.attempts != counts[str(i)]]
    out.update(attempts_under=sum(1 for _, a, n in untrue if a < n),
               attempts_over=sum(1 for _, a, n in untrue if a > n),
               attempts_untrue_calls=[{"call": i, "attempts": a, "runs": n, "started_s": _started(runs, i, t0)}
                                      for i, a, n in untrue[:10]])
    ev = cl.events
    rel = {k[2:] + "_s": round(v - t0, 3) for k, v in ev.items() if k.startswith("t_")}
    out.update({k: v for k, v in ev.items() if not k.startswith("t_")}, **rel,
               supervisors=supervisors, slots_per_supervisor=slots, slot_processes=supervisors * slots,
               capacity=capacity, sleep_s=sleep_s, heartbeat_s=heartbeat_s, clients=clients, start_s=round(t_up - t_start, 1),
               last_answer_s=round(max(answered_at.values()) - t0, 3) if answered_at else None,
               floor_s=round(calls * sleep_s / (supervisors * slots * capacity), 3),
               rss_per_slot_mb=round(sum(m for m, _ in mem) / (supervisors * slots), 1),
               rss_slots_total_mb=round(sum(m for m, _ in mem)), processes_under_supervisors=sum(n for _, n in mem))
    return out


_ROWS = (("calls", "calls"), ("answered", "answered"), ("lost (no successful answer)", "lost"),
         ("never answered", "never_answered"), ("executed twice (ledger)", "executed_twice"),
         ("  of which: slot SIGKILLed mid-run", "twice_after_kill"), ("  of which: unexplained", "twice_unexplained"),
         ("never ran", "never_ran"), ("attempts > 1", "attempts_gt1"), ("attempts untrue", "attempts_untrue"))


def _fmt(r: dict[str, Any]) -> str:
    c, b = r["cluster"], r.get("baseline")
    w = f"{c['supervisors']}x{c['slots_per_supervisor']} cluster"
    lines = [f"{'':36} {w:>16} {'chaos side_effects':>20}"]
    for label, k in _ROWS:
        lines.append(f"{label:36} {c.get(k, '-')!s:>16} {('-' if b is None else b.get(k, '-'))!s:>20}")
    lines += [
        f"cluster: {c['slot_processes']} slot processes (CPU action slots, unisolated bash tool, capacity "
        f"{c['capacity']}), {c['clients']} clients; up in {c['start_s']} s; RSS {c['rss_per_slot_mb']} MB per slot "
        f"({c['rss_slots_total_mb']} MB for {c['processes_under_supervisors']} processes under the supervisors)",
        f"  failed (typed error) {c['failed']}, wrong {c['wrong']}, attempts > 1 where the ledger has one run "
        f"{c['attempts_gt1_ran_once']}, runs on killed processes {c['runs_on_killed']}",
        f"  attempts untrue: {c['attempts_under']} below the ledger's runs (an unannounced rerun), {c['attempts_over']}"
        f" above (a start on a slot killed before the command ran): {c['attempts_untrue_calls']}",
        f"  kills: {c.get('slots_killed')} slots at {c.get('ran_at_slot_kill')} run ({c.get('slot_kill_s')} s), "
        f"back at {c.get('slots_back_s')} s; supervisor s0 + its slots at {c.get('ran_at_supervisor_kill')} run "
        f"({c.get('supervisor_kill_s')} s), dropped by the broker at {c.get('host_dropped_s')} s; broker at "
        f"{c.get('ran_at_broker_kill', '-')} run ({c.get('broker_kill_s', '-')} s), actors back at "
        f"{c.get('actors_back_s', '-')} s",
        f"  last answer {c['last_answer_s']} s after the first submit (floor at full parallelism {c['floor_s']} s)",
        f"  broker counters (heartbeat {c['heartbeat_s']} s): before its kill {c.get('broker_stats_before_kill', '-')};"
        f" at the end {c.get('broker_stats_end')}",
    ]
    if b is not None:
        lines.append(f"chaos side_effects (2 slots, broker killed at {b['ran_before_kill']} runs): last queued call "
                     f"answered {b['queued_last_answer_after_actors_s']} s after the actors re-registered "
                     f"(drain floor {b['drain_floor_s']} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench cluster_chaos",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--supervisors", type=int, default=8, help="supervisors (hosts) (default %(default)s)")
    p.add_argument("--slots", type=int, default=8, help="CPU slots per supervisor (default %(default)s)")
    p.add_argument("--calls", type=int, default=1000, help="side-effecting calls (default %(default)s)")
    p.add_argument("--capacity", type=int, default=2, help="concurrent calls per slot (default %(default)s)")
    p.add_argument("--sleep", type=float, default=3.0, help="seconds each call sleeps (default %(default)s)")
    p.add_argument("--clients", type=int, default=4, help="clients sharing the calls (default %(default)s)")
    p.add_argument("--heartbeat-s", type=float, default=1.0,
                   help="the broker's heartbeat (default %(default)s, the broker's own; chaos side_effects uses 0.3, "
                        "at which 64 slots on a 2-core host miss heartbeats in the burst and are taken for lost)")
    p.add_argument("--kill-slots", type=int, default=4, help="slot processes SIGKILLed (default %(default)s)")
    p.add_argument("--no-broker-kill", action="store_true", help="skip the broker kill (c)")
    p.add_argument("--no-baseline", action="store_true", help="skip chaos side_effects (the baseline)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="libra-cluster-chaos-") as tmp:
        (Path(tmp) / "c").mkdir()
        out["cluster"] = cluster_run(Path(tmp) / "c", a.supervisors, a.slots, a.calls, a.capacity, a.sleep,
                                     a.clients, a.kill_slots, kill_broker=not a.no_broker_kill,
                                     heartbeat_s=a.heartbeat_s)
        if not a.no_baseline:
            (Path(tmp) / "b").mkdir()
            out["baseline"] = chaos.side_effects(Path(tmp) / "b")
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(out, a.json, _fmt)
    c = out["cluster"]
    return 0 if c["lost"] + c["twice_unexplained"] + c["attempts_untrue"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
