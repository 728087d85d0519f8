"""What a rollout instance does when its engine fails or goes away: the failure classes of an engine call, the
release of an engine's memory, and the rebuild of a crashed engine.

Role: the half of :class:`~libra.actors.rollout_role.RolloutRole` that keeps its engine alive (a mixin over its
``engine``, ``contexts``, ``stats``, ``max_batch``, ``placement`` and status file); the module contracts of
``libra.actors.rollout_role`` say what the client sees. Here:

- :meth:`EngineKeeper._classify` runs inside the batcher's ``except`` block and keeps only strings, so the
  exception's traceback (and the frames holding the failed call's tensors) dies when the block is left;
  :meth:`EngineKeeper._engine_failure` runs after it: ``oom`` frees the CUDA cache and halves the batch,
  ``crashed`` releases the dead engine and builds a new one.
- :meth:`EngineKeeper._release_engine` drops the role's reference to the engine, closes it, checks that it is
  gone (``libra.engines.memory.release_memory``) and records the memory before and after in the status file's
  ``memory_releases``.
- :meth:`EngineKeeper._ensure_engine` rebuilds a missing engine with the role's factory, after a back-off
  (``BACKOFF_S``: 2 s doubling to 30 s) once a rebuild failed; ``engine_restarts`` counts the rebuilds.
"""

from __future__ import annotations

import time
from typing import Any

from libra.logging import get_logger

from .tools import ToolError

__all__ = ["EngineKeeper"]

log = get_logger("libra.roles")


class EngineKeeper:
    """Mixin of :class:`~libra.actors.rollout_role.RolloutRole` (see the module docstring)."""

    BACKOFF_S = (2.0, 30.0)  # first retry delay after a failed rebuild or fetch, and its cap (doubling in between)
    engine: Any
    contexts: Any
    stats: dict[str, Any]
    max_batch: int
    placement: Any
    slot: str
    ooms: int
    _factory: Any
    _restart: tuple[float, float]
    _stopped: Any
    _write_status: Any  # the role's status file writer

    def _device(self) -> Any:
        p = self.placement
        return p.device if p is not None and getattr(p, "on_gpu", False) else None

    def _release_engine(self, why: str) -> None:
        """Close the engine, drop it, and release its memory (``libra.engines.memory``); recorded as ``why``."""
        from libra.engines.memory import memory_reading, release_memory, weak

        engine, self.engine = self.engine, None
        if engine is None:
            return
        if not self._stopped.is_set():
            self.contexts.replace_engine(None)
        before = memory_reading(self._device())
        refs = weak(engine, getattr(engine, "model", None))
        close = getattr(engine, "close", None)
        del engine
        if callable(close):
            try:
                close()
            except Exception as exc:  # noqa: BLE001  (a dead engine may fail to close: it is dropped anyway)
                log.warning("engine_close_failed", slot=self.slot, error=f"{type(exc).__name__}: {exc}")
        del close
        self._note_release(why, release_memory(before, refs, self._device()))

    def _note_release(self, why: str, rec: dict[str, Any]) -> None:
        entry = {"why": why, "at": time.time(), **rec}
        self.stats["memory_releases"] = [*self.stats["memory_releases"][-19:], entry]
        self._write_status()
        log.info("rollout_memory_released", slot=self.slot, why=why, memory_before=rec["before"],
                 memory_after=rec["after"], gc_needed=rec["gc_needed"])

    def _ensure_engine(self) -> None:
        """Build a new engine when the last one crashed (after its back-off); raises ``ToolError`` while it
        cannot be built."""
        if self.engine is not None:
            return
        now = time.monotonic()
        retry_at, delay = self._restart
        if now < retry_at:
            raise ToolError("engine_failed", f"the rollout engine is down and being rebuilt (last error: "
                                             f"{self.stats.get('last_restart_error')}); next try in "
                                             f"{retry_at - now:.1f} s")
        try:
            engine = self._factory()
        except Exception as exc:  # noqa: BLE001  (any failure to build: back off and retry)
            delay = min(self.BACKOFF_S[1], delay * 2) if delay else self.BACKOFF_S[0]
            self._restart = (now + delay, delay)
            self.stats["restart_errors"] += 1
            self.stats["last_restart_error"] = f"{type(exc).__name__}: {exc}"
            self._write_status()
            log.warning("engine_restart_failed", slot=self.slot, error=self.stats["last_restart_error"],
                        retry_in_s=delay)
            raise ToolError("engine_failed", f"the rollout engine could not be rebuilt: {type(exc).__name__}: "
                                             f"{exc}") from None
        if hasattr(engine, "max_batch_size"):
            engine.max_batch_size = min(engine.max_batch_size, self.max_batch)
        self.engine = engine
        self.contexts.replace_engine(engine)
        self._restart = (0.0, 0.0)
        self.stats["engine_restarts"] += 1
        self._write_status()
        log.info("engine_restarted", slot=self.slot, restarts=self.stats["engine_restarts"])

    @staticmethod
    def _classify(exc: BaseException) -> tuple[str, str]:
        """``(kind, message)`` of an engine exception: ``oom``, ``crashed`` or ``engine_failed``."""
        from libra.engines.device.cuda import is_cuda_oom
        from libra.engines.rollout_base import EngineCrashed, EngineOutOfMemory

        msg = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, EngineOutOfMemory) or is_cuda_oom(exc):
            return "oom", msg
        return ("crashed" if isinstance(exc, EngineCrashed) else "engine_failed"), msg

    def _engine_failure(self, kind: str, msg: str) -> ToolError:
        """The typed failure of a batch (see the module contracts), called after the ``except`` block: an
        out-of-memory error frees the CUDA cache and halves the batch; a crashed engine is released and
        rebuilt."""
        from libra.engines.device.cuda import free_cuda_cache
        from libra.engines.memory import memory_reading

        if kind == "crashed":
            log.warning("rollout_engine_crashed", slot=self.slot, error=msg)
            self._release_engine("engine_crashed")
            try:
                self._ensure_engine()  # before the next batch; on failure it is retried after a back-off
            except ToolError:
                pass
            then = "a new one serves the next batch" if self.engine is not None else "its rebuild is retried later"
            return ToolError("engine_failed", f"the rollout engine crashed ({msg}); it was closed and {then}")
        if kind != "oom":
            return ToolError(kind, msg)
        before = memory_reading(self._device())
        free_cuda_cache()
        self.ooms += 1
        was = self.max_batch
        self.max_batch = max(1, self.max_batch // 2)
        if hasattr(self.engine, "max_batch_size"):
            self.engine.max_batch_size = min(self.engine.max_batch_size, self.max_batch)
        self.stats["ooms"] = self.ooms
        self.stats["max_batch"] = self.max_batch
        self._note_release("oom", {"before": before, "after": memory_reading(self._device()), "gc_needed": False,
                                   "still_alive": []})
        log.warning("rollout_oom", slot=self.slot, max_batch_before=was, max_batch=self.max_batch, ooms=self.ooms,
                    memory_before=before, memory_after=self.stats["memory_releases"][-1]["after"])
        return ToolError("oom", f"out of memory in the rollout engine (batch lowered {was} -> {self.max_batch}): "
                                f"{msg}")

