"""Rollouts on a serving owner's headroom, for real, on one CPU machine: the owner's p99 time per output token
with and without borrowing, in the same run, and what the borrowing gains.

Processes (loopback): the owner's serving process (``python -m libra.serving --tiny small``, one CPU thread)
under the open-loop load generator (:mod:`libra.bench.serving_load`: Poisson arrivals, fixed lengths), and a
Libra broker with one lent rollout slot (``libra actors --lend owner=serving,kind=serving,...``, the tiny model,
one thread) fed by episode sessions that loop turns for as long as a phase lasts. On a CPU machine the two
share cores, not a GPU: what borrowing costs the owner here is CPU contention, the analogue of sharing a
GPU's compute and memory bandwidth; the rule that protects the owner is the same
(:class:`~libra.policies.lending.HeadroomRule` over the serving process's ``/load``).

Phases, one after the other, each with the same load (rate, lengths, seed):

1. ``calibrate``: the load alone; its p99 TPOT sets the owner's target, fixed before anything is borrowed:
   ``target = slo_factor × that p99`` (default 1.5; not tuned to any result).
2. ``alone``: the load alone again: the owner's serving without borrowing.
3. ``lent, headroom rule``: the load while the lent slot serves rollouts under the headroom rule (lend below
   ``lend_below × target``, reclaim at ``reclaim_above × target``, ``hold_s``, ``deadline_s``).
4. ``lent, never reclaimed``: the same with an owner that never reclaims (a notice owner no notice ever
   reaches): what the rule protects the owner from.

Printed: per phase the owner's p50/p99 TPOT, the share of requests over the target, the RL tokens/s the lent
slot produced, reclaims and returns, and the broker's hand-back slack against each deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from libra.bench.output import emit
from libra.serving.process import start_serving

__all__ = ["main", "run"]

PROMPT = "Hello there, how are you today?"
TURN = "<|im_start|>user\nwhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"


def _pin(pids: list[int], core: int | None) -> None:
    """Put ``pids`` and their threads on one CPU core: the serving process and the lent slot then share one
    device, as on a GPU (no-op with ``core`` None)."""
    if core is None:
        return
    import psutil

    for pid in pids:
        for t in psutil.Process(pid).threads():  # threads started before now keep their own mask otherwise
            with contextlib.suppress(OSError):
                os.sched_setaffinity(t.id, {core})


def _slot_pids(supervisor_pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(supervisor_pid).children(recursive=True)
            if "libra.actors.runtime" in " ".join(c.cmdline())]


class RolloutDriver:
    """Episode sessions looping turns through the broker on a thread, counting the tokens they got."""

    def __init__(self, url: str, model: Path, sessions: int = 4, new_tokens: int = 16, turns: int = 4) -> None:
        self.url, self.model, self.sessions, self.new_tokens, self.turns = url, model, sessions, new_tokens, turns
        self.tokens = 0
        self.turn_count = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> RolloutDriver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    async def _main(self) -> None:
        from transformers import AutoTokenizer

        from libra.client.aio import AsyncClient
        from libra.dataplane import DataPlaneServer

        tok = AutoTokenizer.from_pretrained(self.model)
        with DataPlaneServer() as server:
            async with AsyncClient(self.url) as c:
                await asyncio.gather(*(self._loop(c, tok, server, k) for k in range(self.sessions)))

    async def _loop(self, c: Any, tok: Any, server: Any, k: int) -> None:
        from libra.protocol.payloads_job import EpisodeSampling
        from libra.rl.episode import EpisodeSession

        params = EpisodeSampling(max_new_tokens=self.new_tokens, temperature=1.0, max_total_tokens=1500,
                                 timeout_s=120)
        n = 0
        while not self._stop.is_set():
            s = EpisodeSession(c, tok, f"d{k}-{n}", tok.encode(TURN), params, lambda: None, [], seed=n,
                               prompt_id=f"p{k}", context_server=server)
            n += 1
            try:
                for _ in range(self.turns):
                    if self._stop.is_set():
                        break
                    before = s.gen_tokens
                    await s.generate()
                    self.tokens += s.gen_tokens - before
                    self.turn_count += 1
                    s.add_user("tool output: 42")
                await s.finish()
            except Exception as exc:  # noqa: BLE001 -- counted and reported, the run goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.2)


def _phase(url: str, rate: float, seconds: float, seed: int, target: float | None, driver: RolloutDriver | None,
           status: Any = None) -> dict[str, Any]:
    from libra.bench.serving_load import serving_load

    before = (driver.tokens, driver.turn_count) if driver else (0, 0)
    t0 = time.perf_counter()
    rep = serving_load(url, rate, seconds, prompt=PROMPT, max_tokens=32, seed=seed, tpot_target_s=target)
    dt = time.perf_counter() - t0
    s = rep.summary()
    out = {"sent": s["sent"], "failed": s["failed"], "p50_tpot_ms": _ms(s["p50_tpot_s"]),
           "p99_tpot_ms": _ms(s["p99_tpot_s"]), "over_target": s["tpot_violations"],
           "over_target_pct": round(100 * s["tpot_violations"] / max(1, s["sent"]), 2), "seconds": round(dt, 1)}
    if driver is not None:
        out["rl_tokens_per_s"] = round((driver.tokens - before[0]) / dt, 1)
        out["rl_turns"] = driver.turn_count - before[1]
    if status is not None:
        out["lending"] = {k: v for k, v in status().stats.get("lending", {}).items() if k != "reclaimed"}
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def _lent_cluster(work: Path, model: Path, spec: str) -> Any:
    from libra.local import LocalCluster

    return LocalCluster(cpu_slots=1, actor_args=["--roles", "rollout=1", "--model-dir", str(model),
                                                 "--rollout-batch", "8", "--torch-threads", "1",
                                                 "--actor-id-prefix", "lent", "--lend", spec])


def _borrowing(work: Path, model: Path, url: str, spec: str, a: argparse.Namespace, target: float) -> dict[str, Any]:
    with _lent_cluster(work, model, spec) as cluster:
        cluster.wait_for_actors(1, timeout=180)
        _pin(_slot_pids(cluster.actors.pid), a.core)  # type: ignore[union-attr]
        driver = RolloutDriver(cluster.url, model, sessions=a.sessions).start()
        try:
            time.sleep(2.0)  # the sessions' first turns (the engine warms up)
            res = _phase(url, a.rate, a.seconds, a.seed, target, driver, cluster.status)
        finally:
            driver.stop()
        res["driver_errors"] = len(driver.errors)
        return res


def run(a: argparse.Namespace) -> dict[str, Any]:
    from libra.engines.tiny_model import ensure_tiny_model
    from libra.local import stop_process

    out: dict[str, Any] = {"rate": a.rate, "seconds": a.seconds, "slo_factor": a.slo_factor, "seed": a.seed}
    with tempfile.TemporaryDirectory(prefix="libra-lending-") as tmp:
        work = Path(tmp)
        from libra.engines.tiny_model import TinyModelSpec
        from libra.serving.__main__ import TINY_PRESETS

        model = ensure_tiny_model(spec=TinyModelSpec(**TINY_PRESETS[a.rollout_model]))  # cached once
        proc, url = start_serving(work / "serving.err", window_s=a.window_s)
        _pin([proc.pid], a.core)
        try:
            cal = _phase(url, a.rate, a.seconds, a.seed + 1, None, None)
            target = a.slo_factor * cal["p99_tpot_ms"] / 1000
            out.update(calibrate=cal, target_ms=round(1000 * target, 2))
            out["alone"] = _phase(url, a.rate, a.seconds, a.seed, target, None)
            rule = (f"owner=serving,kind=serving,url={url},target_ms={1000 * target:.3f},hold_s={a.hold_s},"
                    f"deadline_s={a.deadline_s}")
            out["lent_rule"] = _borrowing(work, model, url, rule, a, target)
            never = f"owner=serving,kind=notice,file={work / 'never'},deadline_s={a.deadline_s}"
            out["lent_never_reclaimed"] = _borrowing(work, model, url, never, a, target)
        finally:
            stop_process(proc)
    alone, lent = out["alone"], out["lent_rule"]
    out["p99_ratio_rule"] = round(lent["p99_tpot_ms"] / alone["p99_tpot_ms"], 3) if alone["p99_tpot_ms"] else None
    out["p99_ratio_never"] = (round(out["lent_never_reclaimed"]["p99_tpot_ms"] / alone["p99_tpot_ms"], 3)
                              if alone["p99_tpot_ms"] else None)
    return out


def _fmt(r: dict[str, Any]) -> str:
    lines = [f"lending (real, one CPU machine): serving owner at {r['rate']} req/s x 32 tokens for {r['seconds']} s "
             f"a phase; target {r['target_ms']} ms/token = {r['slo_factor']} x calibration p99 "
             f"({r['calibrate']['p99_tpot_ms']} ms)",
             f"  {'phase':<24}{'p50 ms':>8}{'p99 ms':>8}{'over target':>13}{'RL tok/s':>10}{'reclaims':>9}"
             f"{'returns':>8}  hand-back slack s"]
    for name, key in (("alone", "alone"), ("lent, headroom rule", "lent_rule"),
                      ("lent, never reclaimed", "lent_never_reclaimed")):
        d = r[key]
        lend = d.get("lending", {})
        lines.append(f"  {name:<24}{d['p50_tpot_ms']!s:>8}{d['p99_tpot_ms']!s:>8}{d['over_target_pct']:>12}%"
                     f"{d.get('rl_tokens_per_s', 0.0):>10}{lend.get('reclaims', 0):>9}{lend.get('lent_again', 0):>8}"
                     f"  {lend.get('handback_slack_s', [])}")
    lines.append(f"  owner's p99 with borrowing / alone: {r['p99_ratio_rule']}x under the rule, "
                 f"{r['p99_ratio_never']}x never reclaimed")
    lines.append("  modelled-only: none (real processes); the shared resource is CPU cores, not a GPU")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench lending",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=5.0, help="serving requests per second (default %(default)s)")
    p.add_argument("--seconds", type=float, default=120.0, help="length of each phase (default %(default)s)")
    p.add_argument("--slo-factor", type=float, default=1.5, help="target = this x calibration p99 TPOT")
    p.add_argument("--hold-s", type=float, default=30.0, help="the headroom rule's hold before lending again (its default)")
    p.add_argument("--deadline-s", type=float, default=5.0, help="the owner's hand-back deadline (the rule's default)")
    p.add_argument("--window-s", type=float, default=10.0, help="the serving process's /load window (its default)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent rollout sessions on the lent slot")
    p.add_argument("--rollout-model", default="small", choices=["small", "tiny"],
                   help="the lent slot's model: the serving process's size (small) or the tests' tiny one")
    p.add_argument("--core", type=int, default=0,
                   help="the CPU core the serving process and the lent slot share (-1: no pinning)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    a.core = None if a.core < 0 else a.core
    t0 = time.perf_counter()
    r = run(a)
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(r, a.json, _fmt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
