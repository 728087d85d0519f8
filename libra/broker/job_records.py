"""The records an RL job host (:mod:`libra.broker.job_host`) keeps for ``JobPoll``: one per trained step, and
decision records. Pure.

**Step records** have no ``"kind"`` key (readers treat a missing kind as ``"step"``; eval rounds add
``"kind": "eval"`` records, :mod:`libra.broker.job_eval_rounds`). Besides rewards, throughput, lag, dispatch and
trainer metrics, a step record carries:

- ``oom_retries``: the times the step's training ran out of memory and was retried with smaller
  micro-batches, and ``micro_batch_tokens``: the micro-batch budget of the attempt that succeeded;
- ``rollout_instances`` (actors accepting ``generate`` when the step was recorded), ``train_ranks`` (ranks that
  trained on data), ``rollout_tok_s_per_instance`` and ``train_tok_s_per_rank``: the step's measured costs
  (:class:`~libra.policies.planner.measured.MeasuredCosts`), and ``measured_costs``: their running averages;
- ``predicted_rollout_s``, ``predicted_train_s``, ``predicted_step_s``: what the measured costs of the steps
  before predicted for this one (None on the first step), beside the measured ``rollout_time_s``,
  ``train_time_s`` and ``step_time_s``.

**Decision records** (:func:`decision_record`) are ``{"kind": "decision", "what", "step", "t", "text",
"detail"}``: ``what`` is one of :data:`DECISIONS`, ``step`` the step being prepared or trained, ``t`` seconds
since the job started, ``text`` one human-readable line.
"""

from __future__ import annotations

import statistics
from typing import Any

from libra.policies.planner.measured import prediction_error

from .job_groups import Trajectory

__all__ = ["DECISIONS", "decision_record", "job_totals", "step_record"]

DECISIONS = ("plan", "role_switch", "buckets", "ehp_join", "ehp_leave", "oom_replan")
_RUNNER_INFO = ("texts", "question", "expected", "load_s", "start", "end")  # the runner's own info keys


def decision_record(what: str, step: int, t: float, text: str, detail: dict[str, Any] | None = None) -> dict[str, Any]:
    """One decision record (see the module docstring). Raises ``ValueError`` for an unknown ``what``."""
    if what not in DECISIONS:
        raise ValueError(f"unknown decision {what!r} (known: {', '.join(DECISIONS)})")
    return {"kind": "decision", "what": what, "step": int(step), "t": round(float(t), 3), "text": text,
            "detail": dict(detail or {})}


def job_totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's totals over its records: ``oom_retries`` (all steps), ``decisions`` ({what: count}) and
    ``prediction_error`` (mean |log(predicted / measured)| step seconds over the steps with a prediction)."""
    steps = [r for r in records if "kind" not in r or r.get("kind") == "step"]
    decisions: dict[str, int] = {}
    for r in records:
        if r.get("kind") == "decision":
            decisions[r["what"]] = decisions.get(r["what"], 0) + 1
    return {"oom_retries": sum(int(r.get("oom_retries", 0)) for r in steps), "decisions": decisions,
            "prediction_error": prediction_error((r.get("predicted_step_s"), r.get("step_time_s")) for r in steps)}


def step_record(host: Any, tr: dict[str, Any], outs: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """The record of the step ``tr`` that ``host`` (a ``JobHost``) just trained (``outs``: its ranks' replies,
    in rank order). Advances the host's window clock (``_t_last``, ``_tokens_last``)."""
    trajs: list[Trajectory] = tr["trajs"]
    plan, naive = tr["plan"], tr["naive"]
    st = host.state
    rewards = [t.reward for t in trajs]
    lag = [st.version - t.min_version for t in trajs]
    step_s = now - host._t_last
    window_tokens = host.gen_tokens - host._tokens_last
    host._t_last, host._tokens_last = now, host.gen_tokens
    m = outs[0].get("metrics") or {}
    info = [t.info for t in trajs]
    starts = [float(i["start"]) for i in info if "start" in i]
    ends = [float(i["end"]) for i in info if "end" in i]
    waits = [float(x) for i in info for x in i.get("load_s", [])]
    rollout_s = (max(ends) - min(starts)) if starts and ends else 0.0
    t0 = host.started_at  # spans on the broker's clock, from the job's start: they overlap across steps
    rollout_span = [round(min(t.admitted_at for t in trajs) - t0, 3), round(max(t.done_at for t in trajs) - t0, 3)]
    train_span = [round(tr["t0"] - t0, 3), round(now - t0, 3)]
    tokens = sum(t.gen_tokens for t in trajs)
    calls = sum(int(i.get("tool_calls", 0)) for i in info)
    return {
        "step": tr["step"], "weights_version": int(outs[0]["weights_version"]),
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0, "rewards": rewards,
        "accuracy": statistics.fmean(1.0 if i.get("correct") else 0.0 for i in info),
        "format_rate": statistics.fmean(1.0 if i.get("formatted") else 0.0 for i in info),
        "tool_calls_per_episode": statistics.fmean(float(i.get("tool_calls", 0)) for i in info),
        # successful calls (no error, exit code 0) over all calls of the step; None when none was made
        "tool_success_rate": (sum(int(i.get("tool_ok", 0)) for i in info) / calls) if calls else None,
        # per episode, in trajectory order: what summarize pools into per-quarter means, spreads and n
        "episode_tool_calls": [int(i.get("tool_calls", 0)) for i in info],
        "episode_tool_ok": [int(i.get("tool_ok", 0)) for i in info],
        "episode_correct": [1 if i.get("correct") else 0 for i in info],
        "turns_per_episode": statistics.fmean(len(t.versions) for t in trajs),
        # This step's own trajectories over their rollout window (windows of consecutive steps overlap
        # under the asynchronous pipeline) ...
        "sequences": len(trajs), "gen_tokens": tokens, "tokens_per_s": tokens / rollout_s if rollout_s > 0 else 0.0,
        # ... and everything the job generated between this step's record and the previous one.
        "window_gen_tokens": window_tokens, "window_tokens_per_s": window_tokens / step_s if step_s > 0 else 0.0,
        "step_time_s": step_s, "rollout_time_s": rollout_s,
        "rollout_span_s": rollout_span, "train_span_s": train_span,
        "train_time_s": now - tr["t0"],
        "weight_publish_s": float(outs[0].get("publish_s", 0.0)), "weight_sync_version": st.version,
        "turn_weight_wait_s": max((0.0, *waits)),
        "weights_bytes": int((outs[0].get("weights") or {}).get("bytes", 0)),
        "dispatch": plan.strategy, "dispatch_decided_by": "broker", "rank_tokens": list(plan.rank_tokens),
        "dispatch_imbalance": plan.imbalance, "dispatch_imbalance_round_robin": naive.imbalance,
        "rank_padded_tokens": list(plan.rank_padded_tokens), "micro_batches": [len(x) for x in plan.micro_batches],
        "shard_fetch_s": max(float(o.get("shard_fetch_s", 0.0)) for o in outs),
        "shard_bytes": sum(int(o.get("shard_bytes", 0)) for o in outs),
        "shard_sources": max(int(o.get("shard_sources", 0)) for o in outs),
        "policy_lag_mean": statistics.fmean(lag), "policy_lag_max": max(lag),
        "versions_seen": sorted({v for t in trajs for v in t.versions}), "turn_versions": [t.versions for t in trajs],
        "loss": m.get("loss"), "grad_norm": m.get("grad_norm"), "clip_frac": m.get("clip_frac"),
        "kl_mean": m.get("kl_mean"), "checksums": [o.get("checksum") for o in outs], "ranks": len(outs),
        # pi_theta / pi_rollout over the trained tokens and how many: 1 and gen_tokens when the trainer saw
        # exactly the sampled ids and log-probs at the weights that sampled them
        "ratio_mean": m.get("ratio_mean"), "trained_tokens": m.get("num_tokens"),
        "train_attempts": [tr["attempts"].get(r) for r in range(len(outs))],
        "shard_sequences": [o.get("shard_sequences") for o in outs], **elastic_record(host, tr, outs),
        "dropped_groups": st.dropped_groups, "episodes_failed": host.episodes_failed,
        **signal_record(tr), "checkpoint": tr["checkpoint"],
        "data_position": host.spec.row_offset + st.admitted,
        "samples": [{"question": t.info.get("question"), "expected": t.info.get("expected"), "reward": t.reward,
                     "versions": t.versions, "texts": t.info.get("texts"),
                     "info": {k: v for k, v in t.info.items() if k not in _RUNNER_INFO}}
                    for t in trajs[: host.spec.samples_per_step]],
    }


def signal_record(tr: dict[str, Any]) -> dict[str, Any]:
    """Zero-variance groups: the share among the groups completed since the previous step (filtered ones
    included; None when none completed in that window: with policy lag >= 1 a step's batch may have completed
    before the previous step ended), how many the filter dropped, the share of the trained batch's groups with
    zero advantage (``batch_zero_variance_share``), and whether the trained batch has no signal at all."""
    w = tr["window"]
    return {"zero_variance_groups": w["zero_variance"], "groups_completed": w["completed"],
            "zero_variance_share": w["zero_variance"] / w["completed"] if w["completed"] else None,
            "filtered_groups": w["filtered"], "batch_zero_variance_groups": tr["zero_groups"],
            "batch_zero_variance_share": tr["zero_groups"] / tr["groups"] if tr["groups"] else None,
            "no_signal": tr["zero_groups"] == tr["groups"]}


def elastic_record(host: Any, tr: dict[str, Any], outs: list[dict[str, Any]]) -> dict[str, Any]:
    """An elastic step's group: members in rank order, who contributed zeros, who joined from what."""
    g = tr["group"]
    if g is None:
        return {}
    return {"members": list(g.members), "generation": g.generation, "zero_members": list(g.zero),
            "joining": list(g.joining), "trained_by": [o.get("member") for o in outs],
            "restored_versions": [o.get("restored_version") for o in outs], "ehp": host.elastic.view(),
            # seconds each member spent loading the core's state, forming the group (on a thread, beside
            # its passes) and waiting for that formation
            **{k: [(o.get("metrics") or {}).get(k) for o in outs]
               for k in ("state_fetch_s", "group_form_s", "group_wait_s")}}
