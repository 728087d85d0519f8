"""How full a rollout engine's KV memory is: the reading behind an actor's re-bid by KV use.

Role: after each batch the rollout role asks :func:`engine_kv_use` for ``(used, seqs)``: the fraction of the
engine's KV budget in use (0..1) and the sequences holding it. The actor core (``libra.actors.state``,
event ``KvUse``) turns it into a credit, the sequences of the current mean size that fit the whole budget
(``seqs / used``, capped by the slot's batch size), and re-bids when that moves by more than its threshold.

Sources:

- HF engine: its per-trajectory :class:`~libra.engines.kv_cache.KVCache` (bytes held by the trajectories'
  contexts against ``kv_cache_bytes``; :meth:`KVCache.use`).
- vLLM: the scheduler's gauges from ``LLM.get_metrics()``: ``vllm:kv_cache_usage_perc`` (V1; V0 named it
  ``vllm:gpu_cache_usage_perc``) and ``vllm:num_requests_running``. An offline ``LLM`` keeps no stats unless
  built with ``disable_log_stats = False`` (``LIBRA_VLLM_ARGS='{"disable_log_stats": false}'``); without them
  there is no reading and the actor keeps its bid. Read between ``generate`` calls, so it sees what the
  scheduler still holds then (an offline ``LLM`` has usually finished its requests: the reading is then
  ``(0, 0)``, which leaves the credit at the slot's batch size). Not yet checked against a real vLLM on a GPU.
- Any other engine with a ``kv_use()`` method (test stand-ins) is asked directly.

Returns None when an engine says nothing (the actor then keeps its bid). Never raises for a missing or odd
metric: a reading it cannot make is None.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["VLLM_RUNNING", "VLLM_USAGE", "engine_kv_use", "vllm_kv_use"]

#: vLLM gauge names, newest first.
VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
VLLM_RUNNING = "vllm:num_requests_running"


def _reading(used: Any, seqs: Any) -> tuple[float, int] | None:
    try:
        u, n = float(used), int(seqs)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(u) or u < 0 or n < 0:
        return None
    return min(1.0, u), n


def vllm_kv_use(llm: Any) -> tuple[float, int] | None:
    """``(used, running)`` from a ``vllm.LLM``'s metrics (see the module docstring), or None when it has no
    ``get_metrics`` or neither usage gauge."""
    get = getattr(llm, "get_metrics", None)
    if not callable(get):
        return None
    try:
        metrics = list(get())
    except Exception:  # noqa: BLE001  (stats may be off: no reading, never a failed turn)
        return None
    by_name: dict[str, Any] = {}
    for metric in metrics:
        name = getattr(metric, "name", None)
        if isinstance(name, str) and name not in by_name:
            by_name[name] = getattr(metric, "value", None)
    usage = next((by_name[n] for n in VLLM_USAGE if n in by_name), None)
    if usage is None:
        return None
    return _reading(usage, by_name.get(VLLM_RUNNING, 0) or 0)


def engine_kv_use(engine: Any) -> tuple[float, int] | None:
    """The KV reading of ``engine`` (HF, vLLM or a stand-in with ``kv_use()``), or None."""
    from libra.engines.kv_cache import KVCache

    if engine is None:
        return None
    own = getattr(engine, "kv_use", None)
    if callable(own):
        got = own()
        return None if got is None else _reading(*got)
    cache = getattr(engine, "kv_cache", None)
    if isinstance(cache, KVCache):
        return cache.use()
    llm = getattr(engine, "llm", None)
    return vllm_kv_use(llm) if llm is not None else None
