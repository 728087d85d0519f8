"""What the trackers log of a run-directory record: one step, its scalars and its texts (pure).

Every tracker logs the same names, read from the records that ``metrics.jsonl`` holds (the run directory stays
the source of truth; :func:`record_view` only renames and picks):

- a step record → ``reward/*``, ``episode/*``, ``tools/*``, ``lag/*``, ``time/*`` (rollout, train, weight sync,
  waits), ``throughput/*``, ``train/*``, ``groups/*``, ``weights/version``, ``planner/*`` (the broker's
  predicted step, rollout and train seconds next to the measured step, and ``planner/prediction_log_error``,
  ``|log(predicted / measured)|``) and, when GPU actors report NVML samples, ``gpu/*``;
- an eval record (``"kind": "eval"``) → ``eval/greedy_accuracy``, ``eval/pass_at_K`` (``pass@K`` renamed:
  MLflow refuses ``@`` in a name), the mean rewards; at the step the round followed;
- a decision record (``"kind": "decision"``: a plan, a role switch, a bucket change, an Elastic Hybrid Pool
  join or leave) → the text ``decisions/<what>`` (its ``text`` and ``detail``).

A value that is None, not a number or not finite is left out. :func:`gpu_fields` is what the driver adds to a
step record from the broker's status (``gpu_memory_used_bytes_max``, ``gpu_memory_used_bytes_total``,
``gpu_utilization_pct_mean``, ``gpu_actors``): nothing on a host without GPU actors.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["STEP_SCALARS", "StepView", "gpu_fields", "record_view"]

# scalar name → the step record's key
STEP_SCALARS: dict[str, str] = {
    "reward/mean": "reward_mean", "reward/std": "reward_std",
    "episode/accuracy": "accuracy", "episode/format_rate": "format_rate", "episode/turns": "turns_per_episode",
    "episode/failed": "episodes_failed",
    "tools/calls_per_episode": "tool_calls_per_episode", "tools/success_rate": "tool_success_rate",
    "lag/policy_lag_max": "policy_lag_max", "lag/policy_lag_mean": "policy_lag_mean",
    "time/step_s": "step_time_s", "time/rollout_s": "rollout_time_s", "time/train_s": "train_time_s",
    "time/sync_s": "sync_time_s", "time/weight_wait_s": "turn_weight_wait_s", "time/shard_fetch_s": "shard_fetch_s",
    "throughput/tokens_per_s": "tokens_per_s", "throughput/window_tokens_per_s": "window_tokens_per_s",
    "throughput/rollout_tok_s_per_instance": "rollout_tok_s_per_instance",
    "throughput/train_tok_s_per_rank": "train_tok_s_per_rank", "throughput/gen_tokens": "gen_tokens",
    "train/loss": "loss", "train/grad_norm": "grad_norm", "train/kl_mean": "kl_mean", "train/clip_frac": "clip_frac",
    "train/ratio_mean": "ratio_mean", "train/ranks": "train_ranks",
    "groups/zero_variance_share": "zero_variance_share", "groups/filtered": "filtered_groups",
    "groups/dropped": "dropped_groups",
    "weights/version": "weights_version",
    "planner/predicted_step_s": "predicted_step_s", "planner/predicted_rollout_s": "predicted_rollout_s",
    "planner/predicted_train_s": "predicted_train_s", "planner/measured_step_s": "step_time_s",
    "gpu/actors": "gpu_actors", "gpu/utilization_pct_mean": "gpu_utilization_pct_mean",
}
_GIB = float(2**30)

StepView = tuple[int, dict[str, float], dict[str, str]]


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(float(v)):
        return float(v)
    return None


def _pick(rec: dict[str, Any], names: dict[str, str]) -> dict[str, float]:
    out = {}
    for name, key in names.items():
        v = _num(rec.get(key))
        if v is not None:
            out[name] = v
    return out


def _step_scalars(rec: dict[str, Any]) -> dict[str, float]:
    out = _pick(rec, STEP_SCALARS)
    waits = [w for w in (_num(x) for x in rec.get("group_wait_s") or []) if w is not None]
    if waits:
        out["time/group_wait_s"] = max(waits)
    for name, key in (("gpu/memory_used_gib_max", "gpu_memory_used_bytes_max"),
                      ("gpu/memory_used_gib_total", "gpu_memory_used_bytes_total")):
        v = _num(rec.get(key))
        if v is not None:
            out[name] = v / _GIB
    pred, measured = out.get("planner/predicted_step_s", 0.0), out.get("planner/measured_step_s", 0.0)
    if pred > 0 and measured > 0:
        out["planner/prediction_log_error"] = abs(math.log(pred / measured))
    return out


def _eval_scalars(rec: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in rec.items():
        if k in ("greedy_accuracy", "greedy_reward_mean", "sampled_reward_mean") or k.startswith("pass@"):
            x = _num(v)
            if x is not None:
                out["eval/" + k.replace("@", "_at_")] = x
    return out


def _decision_text(rec: dict[str, Any]) -> str:
    text = str(rec.get("text") or rec.get("what") or "decision")
    t = _num(rec.get("t"))
    when = f" ({t:.1f} s into the job)" if t is not None else ""
    detail = rec.get("detail")
    return f"{text}{when}" + (f"\n{json.dumps(detail, sort_keys=True, default=str)}" if detail else "")


def record_view(rec: dict[str, Any]) -> StepView | None:
    """``(step, scalars, texts)`` of one ``metrics.jsonl`` record (see the module docstring); None for a record
    of a kind the trackers do not log, or without a step."""
    step = rec.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    kind = rec.get("kind", "step")
    if kind == "step":
        return step, _step_scalars(rec), {}
    if kind == "eval":
        return step, _eval_scalars(rec), {}
    if kind == "decision":
        return step, {}, {f"decisions/{rec.get('what') or 'decision'}": _decision_text(rec)}
    return None


def gpu_fields(actors: list[dict[str, Any]]) -> dict[str, float | int]:
    """What a step record gets of the GPU actors' NVML samples (``StatusReply.actors[i]["gpu"]``): the most and
    the total memory used, the mean utilisation and how many reported; {} when none did."""
    samples = [a["gpu"] for a in actors if isinstance(a.get("gpu"), dict) and "memory_used_bytes" in a["gpu"]]
    if not samples:
        return {}
    used = [float(g["memory_used_bytes"]) for g in samples]
    util = [float(g.get("utilization_pct", 0.0)) for g in samples]
    return {"gpu_memory_used_bytes_max": max(used), "gpu_memory_used_bytes_total": sum(used),
            "gpu_utilization_pct_mean": sum(util) / len(util), "gpu_actors": len(samples)}
