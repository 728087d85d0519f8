"""The client side of ``[eval]`` and of the step signal: what ``libra run`` says about eval rounds and steps
without signal, and what it puts in ``summary.json``.

The rounds themselves run in the broker (:mod:`libra.broker.job_eval_rounds`): the eval rows go to the broker with
the job (``JobSpec.eval_rows``) and come back as ``"kind": "eval"`` records in the poll, which the driver
writes to ``metrics.jsonl`` as they come (:func:`eval_line` is the terminal/log line of one).
:func:`eval_summary` is ``summary.json``'s ``eval`` entry: the first and the last round and every round's
scores. :func:`signal_line` is the warning a step gets when every group it trained on had all rewards equal
(no GRPO signal: with ``[grpo] filter_zero_variance`` the filter's bound was spent, without it every group
was flat). :func:`handle_record` is what the driver does with every polled record before its own step
bookkeeping: eval records are written and said, decision records (``"kind": "decision"``: a plan, a role
switch, a bucket change, an Elastic Hybrid Pool join or leave, an out-of-memory re-plan; ``what``, ``step``,
``t``, ``text``, ``detail``) are written to ``metrics.jsonl`` and their ``text`` said (:func:`decision_line`),
a step without signal is said, and a step that saved a checkpoint leaves the data cursor beside it
(``RUN/data_cursor.json``, :mod:`libra.rl.data`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .data import JobData, write_cursor

__all__ = ["SCORES", "decision_line", "eval_line", "eval_summary", "handle_record", "scores", "signal_line"]

SCORES = ("greedy_accuracy", "greedy_reward_mean", "sampled_reward_mean")


def scores(rec: dict[str, Any]) -> dict[str, Any]:
    """The scores of one eval record: greedy accuracy, pass@1, pass@k and the mean rewards it has."""
    return {k: v for k, v in rec.items() if k in SCORES or k.startswith("pass@")}


def eval_line(rec: dict[str, Any]) -> str:
    """``eval after step 4 (12 prompts): greedy_accuracy 0.42, pass@1 0.31, pass@4 0.58``."""
    body = ", ".join(f"{k} {v:.3f}" for k, v in scores(rec).items() if isinstance(v, (int, float)))
    failed = f", {rec['episodes_failed']} episode(s) failed" if rec.get("episodes_failed") else ""
    return f"eval after step {rec['step']} ({rec.get('prompts', '?')} prompts): {body}{failed}"


def decision_line(rec: dict[str, Any]) -> str:
    """``[libra] step 3, 41.2 s: borrowed hybrid slot cpu1 for training (training_bottleneck)``: the record's
    ``text``, or its ``what`` and ``detail`` when it has none."""
    text = rec.get("text") or f"{rec.get('what', 'decision')} {rec.get('detail', {})}"
    t = rec.get("t")
    when = f", {float(t):.1f} s" if isinstance(t, (int, float)) else ""
    return f"[libra] step {rec.get('step', '?')}{when}: {text}"


def signal_line(rec: dict[str, Any]) -> str | None:
    """A warning for a step record whose batch has no signal (every group's rewards equal), else None."""
    if not rec.get("no_signal"):
        return None
    window = (f"zero-variance share of the {rec['groups_completed']} groups completed since the last step "
              f"{rec.get('zero_variance_share', 0.0):.2f}" if rec.get("groups_completed")
              else "all of them completed before the last step")
    return (f"step {rec['step']} trained on no signal: all {rec.get('batch_zero_variance_groups', '?')} groups had "
            f"equal rewards ({window}, {rec.get('filtered_groups', 0)} filtered); its gradient "
            "is zero: check the reward, " + ("or raise [grpo] max_extra_groups" if rec.get("filtered_groups")
                                             else "or set [grpo] filter_zero_variance = true"))


def eval_summary(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s ``eval`` entry ({} without eval rounds)."""
    if not evals:
        return {}
    return {"rounds": len(evals), "prompts": evals[-1].get("prompts"), "k": evals[-1].get("k"),
            "first": {"step": evals[0]["step"], **scores(evals[0])},
            "last": {"step": evals[-1]["step"], **scores(evals[-1])},
            "by_step": [{"step": r["step"], **scores(r)} for r in evals]}


def handle_record(rec: dict[str, Any], run_dir: Path, data: JobData, metrics: Any, say: Callable[[str], None]) -> bool:
    """See the module docstring; True when ``rec`` was an eval or decision record (written here, nothing more
    to do)."""
    kind = rec.get("kind", "step")
    if kind != "step":  # eval, decision (a kind this client does not know yet is kept, unsaid)
        metrics.write(rec)
        if kind in ("eval", "decision"):
            say(eval_line(rec) if kind == "eval" else decision_line(rec))
        return True
    warn = signal_line(rec)
    if warn:
        say(warn)
    if rec.get("checkpoint"):
        write_cursor(run_dir, data.cursor(int(rec["data_position"]), int(rec["step"]), str(rec["checkpoint"])))
    return False
