"""Where a rollout instance gets a turn's context: its own cache, the previous instance, or the session.

Role: the rollout role's half of the delta protocol (:class:`~libra.protocol.payloads_rollout.TurnContext`).
A turn in the delta form names only its new tokens; :meth:`ContextService.resolve` turns it into the whole
prompt, and :meth:`ContextService.generate` runs the engine with the trajectory id as its cache key.

Contracts:
- Hit: the instance holds the trajectory's context with the turn's ``prefix_len`` and ``prefix_digest``:
  prompt = held ids + new ids (``context_via`` ``"cache"``, or ``"local"`` when new weights dropped its KV).
- Miss (evicted, restarted, or the trajectory moved here): with ``Assign.route["mode"] == "kv"`` and a
  ``holder`` (the previous instance), its ids and KV cache are fetched over the data plane and imported
  (``"kv"``); otherwise, or when that fails, the ids are fetched from the session's ``source`` and then from
  the holder, and the engine re-prefills them (``"ids"``). Nothing reachable: ``ToolError("context_missing")``.
- Every context is checked against the turn's digests before the engine sees it: a prefix or whole context
  whose digest differs fails the turn with ``ToolError("context_mismatch")``; nothing is ever generated from
  a context the session did not send.
- The instance serves what it holds on its own data-plane server, made on demand when another instance asks:
  ``ctx/TRAJ/kv`` (ids + KV, ``libra.weights.format`` format, see ``libra.engines.kv_cache.pack_context``)
  and ``ctx/TRAJ/ids`` (:func:`~libra.protocol.payloads_rollout.ids_object`). Each reply names it in
  ``context_at``.
- Engines without a KV cache of their own (vLLM, whose prefix caching works inside the engine) get an
  ids-only store here, so the delta form works with every engine.
- References: the data-plane server reaches this service only through a weak reference (no cycle through its
  provider), and :meth:`ContextService.close` stops the server and drops the engine and the store, so nothing
  here keeps a closed engine's model or KV alive. :meth:`ContextService.replace_engine` swaps in a rebuilt
  engine (after a crash): the contexts the dead engine held are gone, the next turn fetches its ids again.
"""

from __future__ import annotations

import weakref
from array import array
from dataclasses import dataclass
from typing import Any

from libra.engines.kv_cache import ContextEntry, KVCache, pack_context, unpack_context
from libra.logging import get_logger
from libra.protocol.payloads_refs import DataRef
from libra.protocol.payloads_rollout import (
    ContextDigest,
    GenerateArgs,
    TurnContext,
    context_digest,
    ids_from_object,
    ids_object,
)

from .tools import ToolError

__all__ = ["ContextService", "Turn"]

log = get_logger("libra.roles")

IDS_ONLY_BUDGET = 256 << 20  # token ids kept for engines without a cache of their own


@dataclass(frozen=True, slots=True)
class Turn:
    """One resolved turn waiting for the engine."""

    req: Any  # GenRequest
    key: str | None  # the trajectory id (the cache key), None for a turn without one
    via: str  # how the context was had (GenerateResult.context_via)
    cancelled: Any = None  # the work's cancel event (threading.Event), None for a turn nothing cancels


class ContextService:
    """See the module contracts. ``engine`` is the rollout engine; ``keys`` the data-plane keys."""

    def __init__(self, engine: Any, keys: Any = None, *, fetch_timeout_s: float = 10.0) -> None:
        from libra.dataplane import DataPlaneServer, allow_dir_from_env

        self.keys = keys
        self.fetch_timeout_s = fetch_timeout_s
        self.replace_engine(engine)
        self.server = DataPlaneServer(keys=keys, allow_dir=allow_dir_from_env(), provider=_weak_provider(self))
        self.stats = {"cache": 0, "local": 0, "kv": 0, "ids": 0, "new": 0, "full": 0, "kv_fetch_failed": 0}

    def replace_engine(self, engine: Any) -> None:
        """Serve with ``engine`` from now on (see the module contracts)."""
        self.engine = engine
        self.own_cache = not isinstance(getattr(engine, "kv_cache", None), KVCache)
        self.store: KVCache = KVCache(IDS_ONLY_BUDGET) if self.own_cache else engine.kv_cache

    def close(self) -> None:
        """Stop serving contexts and drop the engine and the store. Idempotent."""
        self.server.close()
        self.engine = None
        self.store = KVCache(0)

    # ------------------------------------------------------------------ resolving a turn
    def resolve(self, trajectory: str | None, ga: GenerateArgs, route: Any) -> tuple[list[int], str]:
        """The whole prompt of a turn and how it was had (see the module contracts)."""
        if ga.prompt_ids is not None:
            self.stats["full"] += 1
            return list(ga.prompt_ids), "full"
        c = ga.context
        assert c is not None
        if trajectory is None:
            raise ToolError("bad_request", "a turn in the delta form (context) needs a trajectory id")
        mode = route.get("mode") if isinstance(route, dict) else None
        if c.prefix_len == 0:
            prefix, digest, via = array("I"), ContextDigest(), "new"
        else:
            e = self.store.get(trajectory, touch=False)
            if e is not None and len(e.ids) == c.prefix_len and e.digest.hexdigest() == c.prefix_digest:
                fresh = e.kv is not None and e.version == self.engine.weights_version
                prefix, digest, via = e.ids, e.digest.copy(), "cache" if fresh or self.own_cache else "local"
            else:
                prefix, digest, via = self._fetch(trajectory, c, mode)
        digest.update(c.new_ids)
        if digest.hexdigest() != c.digest:
            raise ToolError("context_mismatch", f"trajectory {trajectory!r}: the context ({digest.length} tokens) "
                                                f"does not match the turn's digest; refusing to generate from it")
        self.stats[via] += 1
        return prefix.tolist() + list(c.new_ids), via

    def _fetch(self, traj: str, c: TurnContext, mode: Any) -> tuple[array, ContextDigest, str]:
        from libra.dataplane import DataPlaneError, fetch, fetch_state_dict

        holder = c.holder if c.holder is not None and c.holder.endpoint != self.server.endpoint else None
        if mode == "kv" and holder is not None:
            try:
                sd, hdr, _ = fetch_state_dict(self._ref(holder, "/kv"), keys=self.keys,
                                              idle_timeout_s=self.fetch_timeout_s)
                entry = unpack_context(sd, hdr.metadata)
            except (DataPlaneError, ValueError, KeyError) as exc:
                self.stats["kv_fetch_failed"] += 1
                log.info("context_kv_fetch_failed", trajectory=traj, holder=holder.endpoint, error=str(exc))
            else:
                self._check_prefix(traj, entry.ids, c)
                self._hold(traj, entry)  # a holder without KV (dropped, or an engine without a cache) sent ids
                return entry.ids, entry.digest.copy(), "kv" if entry.kv is not None else "ids"
        errors = []
        for ref, suffix in ((c.source, ""), (holder, "/ids")):
            if ref is None:
                continue
            try:
                header, chunks, _ = fetch(self._ref(ref, suffix), keys=self.keys, idle_timeout_s=self.fetch_timeout_s)
                ids = ids_from_object(header, chunks)
            except (DataPlaneError, ValueError) as exc:
                errors.append(f"{ref.endpoint}: {exc}")
                continue
            ids = ids[: c.prefix_len]
            self._check_prefix(traj, ids, c)
            return ids, ContextDigest(ids), "ids"
        raise ToolError("context_missing", f"trajectory {traj!r}: this instance does not hold its context and could "
                                           f"not fetch it ({'; '.join(errors) or 'no source or holder named'})")

    @staticmethod
    def _ref(ref: DataRef, suffix: str) -> Any:
        from libra.dataplane import ObjectRef

        return ObjectRef(ref.endpoint, ref.name + suffix, None, ref.server_key)

    @staticmethod
    def _check_prefix(traj: str, ids: array, c: TurnContext) -> None:
        if len(ids) != c.prefix_len or context_digest(ids) != c.prefix_digest:
            raise ToolError("context_mismatch", f"trajectory {traj!r}: the fetched context ({len(ids)} tokens) does "
                                                f"not match the turn's prefix ({c.prefix_len} tokens, digest "
                                                f"{c.prefix_digest}); refusing to generate from it")

    def _hold(self, traj: str, entry: ContextEntry) -> None:
        if self.own_cache:
            self.store.put(traj, entry.without_kv())
        else:
            self.engine.import_context(traj, entry)

    # ------------------------------------------------------------------ running turns
    def generate(self, turns: list[Turn]) -> list[Any]:
        """One engine call for ``turns``; the engine (or, for engines without a cache, this service) keeps each
        trajectory's context for its next turn."""
        reqs = [t.req for t in turns]
        stop: dict[str, Any] = {}
        if getattr(self.engine, "cancellable", False) and any(t.cancelled is not None for t in turns):
            stop["cancelled"] = [t.cancelled.is_set if t.cancelled is not None else None for t in turns]
        if self.own_cache:
            results = self.engine.generate(reqs, **stop)
            for t, r in zip(turns, results):
                if t.key is not None and r.finish_reason != "cancelled":
                    ids = array("I", t.req.prompt_ids)
                    ids.extend(r.token_ids)
                    self.store.put(t.key, ContextEntry(ids, ContextDigest(ids), None, 0, r.weights_version))
            return results
        return self.engine.generate(reqs, sessions=[t.key for t in turns], **stop)

    def reply_fields(self, turn: Turn, result: Any) -> dict[str, Any]:
        """The ``GenerateResult`` fields about the context: ``context_at``, ``context_via``, ``prefill_tokens``."""
        at = None
        if turn.key is not None:
            at = DataRef(endpoint=self.server.endpoint, name=f"ctx/{turn.key}", server_key=self.server.server_key)
        cached = getattr(result, "cached_tokens", 0)
        return {"context_at": at, "context_via": turn.via, "prefill_tokens": max(0, len(turn.req.prompt_ids) - cached)}

    # ------------------------------------------------------------------ serving what this instance holds
    def _provide(self, name: str) -> tuple[bytes, list[bytes]] | None:
        if not name.startswith("ctx/") or not name.endswith(("/kv", "/ids")):
            return None
        traj, _, what = name[4:].rpartition("/")
        entry = self.store.get(traj, touch=False)
        if entry is None:
            raise KeyError(f"no context held for trajectory {traj!r}")
        if what == "ids":
            return ids_object(entry.ids)
        from libra.weights.format import pack_state_dict

        tensors, meta = pack_context(entry, with_kv=True)
        header, chunks = pack_state_dict(tensors, metadata=meta)
        return header, list(chunks)


def _weak_provider(service: ContextService) -> Any:
    """The data-plane provider of ``service`` through a weak reference: the server keeps no cycle to it."""
    ref = weakref.ref(service)

    def provide(name: str) -> tuple[bytes, list[bytes]] | None:
        s = ref()
        return None if s is None else s._provide(name)

    return provide
