"""The ``episode`` role: an episode runner that runs agent loops for the broker's RL jobs.

Role: a CPU slot that accepts ``episode`` work (``name``: the environment). Each episode runs the
environment's ``episode(session, problem, env_config)`` function on one asyncio loop shared by all the
slot's episodes; the session (:class:`libra.rl.episode.EpisodeSession`) sends every model turn as
``generate`` work and every tool call as ``action`` work to the broker, with the trajectory id, so the
C-MLFQ router and the action scheduler see every turn. The turns name no weights: the broker attaches
the job's newest version to each turn it assigns.

Contracts:
- ``episode`` args are a :class:`~libra.protocol.payloads_job.EpisodeArgs` (its field docstrings are the
  contract; a malformed mapping fails the work with ``bad_request``), the reply an
  :class:`~libra.protocol.payloads_job.EpisodeResult`. The tokenizer comes from ``episode.model_dir`` when
  that directory exists here, else from the slot's ``--model-dir``.
- The finished trajectory's tensors (token ids, loss mask, rollout log-probs) stay here: they are
  published on this runner's data-plane server as ``traj/JOB/gG/I/WORK`` (tagged job JOB: with
  ``LIBRA_CURVE_ALLOW`` set, only that job's scoped client keys and unscoped keys may fetch it, see
  ``libra.dataplane.access``) and the reply carries only the
  ref, the reward, the versions each turn used, token counts and a small ``info`` (the environment's
  own info, the decoded turns, start/end wall-clock times, weight-load waits). A trainer rank fetches the
  tensors directly; the broker never sees them.
- Published trajectories are kept ``retain_s`` seconds (default 1 h) or until ``max_retained`` newer ones
  exist, whichever comes first; a step trained later than that fails with ``shard_fetch_failed``.
- The environment is loaded through :mod:`libra.envs.loader` from the spec's ``env_config`` (``entry`` or
  ``name``, and ``options``, validated again here; loaded once per runner and spec): a module, a class
  (instantiated once) or an instance. A spec whose environment cannot be loaded, or a row ``from_row``
  rejects, fails the work with ``bad_request``.
- A failing episode (a turn that cannot be served, an exception inside the environment's ``episode``, a
  reward that is not a finite number) fails the work with code ``episode_failed`` and the text of
  :func:`libra.envs.contract.format_failure`: the error line, then the traceback (at most 8 KiB); the driver
  writes it to ``RUN/failures.jsonl`` and the broker's job trains that group without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from libra.logging import get_logger
from libra.protocol.payloads_base import PayloadError
from libra.protocol.payloads_job import EpisodeArgs, EpisodeResult
from libra.protocol.payloads_refs import DataRef

from .tools import ToolError, WorkContext

__all__ = ["EpisodeRole"]

log = get_logger("libra.episode_role")


class EpisodeRole:
    """See the module contracts. ``episode`` is the work handler (thread-safe; blocks its worker thread)."""

    def __init__(self, broker_url: str, model_dir: str | None, slot: str, *, retain_s: float = 3600.0,
                 max_retained: int = 20_000) -> None:
        from libra.dataplane import DataPlaneKeys, DataPlaneServer, allow_dir_from_env

        self.broker_url = broker_url
        self.model_dir = model_dir
        self.slot = slot
        self.retain_s = retain_s
        self.max_retained = max_retained
        self.server = DataPlaneServer(keys=DataPlaneKeys.from_env(), allow_dir=allow_dir_from_env())
        self._held: deque[tuple[float, str]] = deque()
        self._held_lock = threading.Lock()
        self._tok: dict[str, tuple[Any, list[int]]] = {}
        self._tok_lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="libra-episodes", daemon=True)
        self._thread.start()
        self._envs: dict[str, tuple[Any, dict[str, Any]]] = {}  # env_config (JSON) -> (environment, options)
        self._envs_lock = threading.Lock()
        self._client: Any = None
        self._client_lock: asyncio.Lock | None = None  # made on the loop thread

    # ------------------------------------------------------------------ handler
    def episode(self, args: Any, ctx: WorkContext) -> dict[str, Any]:
        """One ``episode`` work: :class:`EpisodeArgs` in, :class:`EpisodeResult` (as a mapping) out."""
        try:
            ea = EpisodeArgs.from_wire(args)
        except PayloadError as exc:
            raise ToolError("bad_request", str(exc)) from None
        fut = asyncio.run_coroutine_threadsafe(self._run(ea, ctx), self.loop)
        return fut.result()

    async def _client_ready(self) -> Any:
        """The one broker client all of this slot's episodes share (created once, under a lock: episodes
        starting together must not each open a client with the same id)."""
        import os
        import uuid

        from libra.client.aio import AsyncClient
        from libra.transport.security import CurveClient

        if self._client_lock is None:
            self._client_lock = asyncio.Lock()
        async with self._client_lock:
            if self._client is None:
                cid = f"episodes-{self.slot}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
                curve = CurveClient.from_env(as_client=True)  # the host's client key, under key roles
                self._client = await AsyncClient(self.broker_url, client_id=cid, curve=curve).connect(30.0)
        return self._client

    def _env(self, env_config: dict[str, Any]) -> tuple[Any, Any]:
        """``(environment, EnvConfig with validated options)`` of a spec's ``env_config`` (cached)."""
        from libra.config import ConfigError, from_mapping
        from libra.envs.loader import load_env_config
        from libra.rl.config import EnvConfig

        key = json.dumps(env_config, sort_keys=True, default=str)
        with self._envs_lock:
            if key not in self._envs:
                where = "episode env_config"
                try:
                    cfg = from_mapping(EnvConfig, dict(env_config), where)
                    env, options = load_env_config(cfg, where)
                except ConfigError as exc:
                    raise ToolError("bad_request", str(exc)) from None
                self._envs[key] = (env, dataclasses.replace(cfg, options=options))
            return self._envs[key]

    def _tokenizer(self, wanted: Any) -> tuple[Any, list[int]]:
        d = wanted if isinstance(wanted, str) and (Path(wanted) / "config.json").is_file() else self.model_dir
        if d is None:
            raise ToolError("bad_request", "no tokenizer: the job names no model_dir here and the slot has no --model-dir")
        with self._tok_lock:
            if d not in self._tok:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(d)
                stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
                self._tok[d] = (tok, sorted(int(t) for t in stop if isinstance(t, int) and t >= 0))
            return self._tok[d]

    async def _run(self, args: EpisodeArgs, ctx: WorkContext) -> dict[str, Any]:
        from libra.envs.contract import format_failure, prompt_messages
        from libra.envs.loader import reward_outcome
        from libra.rl.episode import EpisodeSession
        from libra.rl.shards import encode_trajectory

        spec = args.episode
        env, env_cfg = await asyncio.to_thread(self._env, spec.env_config)
        try:
            problem = env.from_row(args.row)
            prompt = getattr(problem, "prompt", None)
            if prompt is None and isinstance(problem, dict):
                prompt = problem.get("prompt")
            messages = prompt_messages(prompt)
        except Exception as exc:  # noqa: BLE001  (a plug-in's from_row may raise anything)
            raise ToolError("bad_request", f"episode: the environment's from_row: {type(exc).__name__}: {exc}") from None
        params = spec.sampling
        tok, stop_ids = await asyncio.to_thread(self._tokenizer, spec.model_dir)
        client = await self._client_ready()
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tok.encode(text, add_special_tokens=False)
        traj_id = f"{ctx.trajectory or args.job}/{ctx.work_id}"
        # one id per prompt text, stable across steps and epochs: the GRPO group's samples share C-MLFQ's
        # per-prompt prefix tree
        prompt_id = "p-" + hashlib.sha1(text.encode()).hexdigest()[:16]
        s = EpisodeSession(client, tok, traj_id, prompt_ids, params, lambda: None, stop_ids,
                           seed=args.seed, prompt_id=prompt_id, context_server=self.server)
        t0 = time.time()
        ok = False
        try:
            reward, info = reward_outcome(await env.episode(s, problem, env_cfg))
            json.dumps(info)  # the info travels in the reply: a value that cannot is the episode's failure
            ok = True
        except Exception as exc:  # noqa: BLE001  (an episode's failure is recorded, with its traceback)
            log.warning("episode_failed", job=args.job, group=args.group, index=args.index, error=repr(exc)[:300])
            raise ToolError("episode_failed", format_failure(exc)) from None
        finally:
            await s.finish(ok)
        tensors, header = encode_trajectory(s.input_ids, s.loss_mask, s.logprobs,
                                            meta={"group": args.group, "index": args.index})
        name = f"traj/{args.job}/g{args.group}/{args.index}/{ctx.work_id}"
        ref = self.server.publish_state_dict(name, tensors, metadata=header, job=args.job)
        self._retain(name)
        info = dict(info)
        info.update({"load_s": s.load_s, "start": t0, "end": time.time(), "texts": s.texts,
                     "question": getattr(problem, "question", None), "expected": getattr(problem, "answer", None),
                     "runner": self.slot})
        return EpisodeResult(reward=float(reward), versions=list(s.versions), gen_tokens=s.gen_tokens,
                             tokens=len(s.input_ids), ref=DataRef.from_wire(ref.to_wire()), info=info).to_wire()

    def _retain(self, name: str) -> None:
        now = time.monotonic()
        with self._held_lock:
            self._held.append((now, name))
            while self._held and (len(self._held) > self.max_retained or now - self._held[0][0] > self.retain_s):
                self.server.retire(self._held.popleft()[1])

    def close(self) -> None:
        self.server.close()
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.close(), self.loop).result(5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()
