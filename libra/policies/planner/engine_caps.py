"""What the rollout engines can serve, as planner knobs: the TP degrees a plan may use.

Role: an actor reports in its hello labels the largest rollout TP group it can lead (``max_tp``: 1 for the HF
engine, the node's GPUs for vLLM). The planner must not plan a larger group, so the candidate rollout TP
degrees (``PlannerConfig.rollout_tps``) and a static allocator's fixed ``rollout_tp`` are capped at the
smallest ``max_tp`` the GPU actors report. Pure: labels in, knobs out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .types import PlannerConfig, PlannerError

__all__ = ["cap_rollout_tps", "cluster_max_tp", "pin_rollout_tp"]

_DEFAULT_TPS: tuple[int, ...] = PlannerConfig.__dataclass_fields__["rollout_tps"].default  # type: ignore[assignment]


def cluster_max_tp(labels: Iterable[Mapping[str, Any]]) -> int | None:
    """The smallest ``max_tp`` among the GPU actors' ``labels`` (None when none reports one: no cap)."""
    caps = [int(v) for lab in labels if isinstance(v := lab.get("max_tp"), int) and not isinstance(v, bool)]
    return min(caps) if caps else None


def cap_rollout_tps(params: Mapping[str, Any], max_tp: int | None) -> dict[str, Any]:
    """``params`` (``make_allocator`` knobs) with ``rollout_tps`` limited to degrees <= ``max_tp`` and a fixed
    ``rollout_tp`` lowered to ``max_tp``. Unchanged when ``max_tp`` is None. Raises :class:`PlannerError` when
    no candidate degree is left."""
    out = dict(params)
    if max_tp is None:
        return out
    if max_tp < 1:
        raise PlannerError(f"max rollout TP must be >= 1, got {max_tp}")
    tps = tuple(t for t in out.get("rollout_tps", _DEFAULT_TPS) if t <= max_tp)
    if not tps:
        raise PlannerError(f"no rollout TP degree in {tuple(out.get('rollout_tps', ()))} is <= {max_tp}, the "
                           "largest group the connected rollout engines can serve")
    out["rollout_tps"] = tps
    if "rollout_tp" in out and int(out["rollout_tp"]) > max_tp:
        out["rollout_tp"] = max_tp
    return out


def pin_rollout_tp(params: Mapping[str, Any], tp: int | None) -> dict[str, Any]:
    """``params`` with the rollout TP fixed at ``tp`` (``rollout_tps = (tp,)``, and ``rollout_tp`` where the
    allocator takes one); unchanged when ``tp`` is None. Raises :class:`PlannerError` for ``tp < 1``."""
    out = dict(params)
    if tp is None:
        return out
    if tp < 1:
        raise PlannerError(f"a pinned rollout TP must be >= 1, got {tp}")
    out["rollout_tps"] = (tp,)
    if "rollout_tp" in out:
        out["rollout_tp"] = tp
    return out
