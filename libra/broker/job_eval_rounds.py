"""Eval rounds of an RL job inside the broker: eval rows → ``episode`` work → one ``"kind": "eval"`` record.

Pure (no I/O, no clocks). The job host (:mod:`libra.broker.job_host`) starts a round after every ``eval_every``
steps and after the last step. A round is ordinary ``episode`` work through the same episode runners and
the same broker paths as training episodes (C-MLFQ routes its turns, the newest weights serve them), but
its results are only counted, never batched: no eval trajectory enters a GRPO group.

Per eval prompt a round runs one greedy episode (temperature 0; ``greedy``) and ``k`` sampled ones (the
job's sampling with ``temperature``). An episode is correct when its info says ``correct`` (else when its
reward is > 0); a failed episode counts as incorrect and is counted in ``episodes_failed``. The record has
``greedy_accuracy``, ``pass@1`` and ``pass@k`` (the unbiased estimator :func:`pass_at_k` over the ``k``
samples of each prompt, averaged over prompts) and the mean rewards. Seeds depend on the prompt and sample
only, so every round of a job samples alike and rounds differ by the weights alone.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import msgspec

from libra.protocol.payloads_base import PayloadError
from libra.protocol.payloads_job import EpisodeArgs, EpisodeResult, EpisodeSpec

__all__ = ["EvalRounds", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al., 2021); needs ``1 <= k <= n``."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class EvalRounds:
    """The eval rounds of one job: :meth:`start` hands out the works of a round, :meth:`on_reply` takes their
    results back and returns the round's record once its last episode is in."""

    def __init__(self, job: str, rows: list[dict[str, Any]], episode: EpisodeSpec, *, greedy: bool, k: int,
                 temperature: float, seed: int) -> None:
        self.job, self.rows = job, rows
        self.k, self.greedy, self.seed = k, greedy, seed
        self._greedy_spec = msgspec.structs.replace(
            episode, sampling=msgspec.structs.replace(episode.sampling, temperature=0.0))
        self._sampled_spec = msgspec.structs.replace(
            episode, sampling=msgspec.structs.replace(episode.sampling, temperature=temperature))
        self._rounds: dict[int, dict[str, Any]] = {}  # step -> {"live", "results", "t0", "version"}

    @property
    def enabled(self) -> bool:
        return bool(self.rows) and (self.greedy or self.k > 0)

    @property
    def live(self) -> int:
        """Eval episodes in flight over all rounds."""
        return sum(len(r["live"]) for r in self._rounds.values())

    def running(self, step: int) -> bool:
        return step in self._rounds

    def start(self, step: int, version: int, now: float) -> list[tuple[str, dict[str, Any], str]]:
        """The works of the round after step ``step``: ``(tag, episode args, trajectory id)`` each."""
        out = []
        rnd = {"live": set(), "results": {}, "t0": now, "version": version}
        modes = ([("g", 0, self._greedy_spec)] if self.greedy else []) + [
            (f"s{j}", 1 + j, self._sampled_spec) for j in range(self.k)]  # (mode, episode index, spec)
        for p, row in enumerate(self.rows):
            for m, j, spec in modes:
                args = EpisodeArgs(job=self.job, row=row, index=j, seed=self.seed * 1_000_003 + 7_000_000 + p * 1000 + j,
                                   episode=spec)
                tag = f"ev:{step}:{p}:{m}"
                rnd["live"].add(tag)
                out.append((tag, args.to_wire(), f"job:{self.job}/eval{step}/{p}/{m}"))
        self._rounds[step] = rnd
        return out

    def on_reply(self, tag: str, ok: bool, out: Any, now: float) -> dict[str, Any] | None:
        """Count the result of eval work ``tag``; the round's record when it was the round's last."""
        _, step_s, p_s, mode = tag.split(":")
        rnd = self._rounds.get(int(step_s))
        if rnd is None or tag not in rnd["live"]:
            return None
        rnd["live"].discard(tag)
        res = None
        if ok:
            try:
                res = EpisodeResult.from_wire(out)
            except PayloadError:
                res = None
        if res is None:
            rnd["results"][(int(p_s), mode)] = None
        else:
            correct = bool(res.info["correct"]) if "correct" in res.info else res.reward > 0
            rnd["results"][(int(p_s), mode)] = (correct, float(res.reward))
        if rnd["live"]:
            return None
        del self._rounds[int(step_s)]
        return self._record(int(step_s), rnd, now)

    def _record(self, step: int, rnd: dict[str, Any], now: float) -> dict[str, Any]:
        res = rnd["results"]
        n = len(self.rows)
        rec: dict[str, Any] = {"kind": "eval", "step": step, "weights_version": rnd["version"], "prompts": n,
                               "k": self.k, "eval_time_s": now - rnd["t0"],
                               "episodes_failed": sum(1 for v in res.values() if v is None)}
        if self.greedy:
            g = [res.get((p, "g")) for p in range(n)]
            rec["greedy_accuracy"] = statistics.fmean(1.0 if v and v[0] else 0.0 for v in g)
            rec["greedy_reward_mean"] = statistics.fmean(v[1] if v else 0.0 for v in g)
        if self.k:
            per = [[res.get((p, f"s{j}")) for j in range(self.k)] for p in range(n)]
            correct = [sum(1 for v in vs if v and v[0]) for vs in per]
            rec["pass@1"] = statistics.fmean(pass_at_k(self.k, c, 1) for c in correct)
            rec[f"pass@{self.k}"] = statistics.fmean(pass_at_k(self.k, c, self.k) for c in correct)
            rec["sampled_reward_mean"] = statistics.fmean(v[1] if v else 0.0 for vs in per for v in vs)
        return rec
