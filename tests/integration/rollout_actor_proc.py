"""One real actor process for the EARL and KV re-bid integration tests: ``python rollout_actor_proc.py MODE URL SLOT
[ARG]``.

- ``standin``: a GPU-named rollout slot whose stand-in engine reports ``max_tp = 2`` (the HF engine serves TP 1
  only and vLLM needs a GPU), so the broker may put it in a TP-2 group. The actor core, its directives and TP
  group membership are the real ones (``ActorRuntime`` / ``ActorState``); a turn's reply names the group config
  its actor was last reconfigured with.
- ``hf``: a real rollout role (``RolloutRole`` over the HF engine on the tiny model at ARG, whose KV cache is
  capped at ``$KV_BUDGET_BYTES``), wired to the actor core's KV re-bid exactly as ``libra.actors.runtime`` does
  (``attach_kv_reports``).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from libra.actors.runtime import ActorRuntime
from libra.actors.state import ActorIdentity


def main(mode: str, url: str, slot: str, arg: str = "") -> None:
    labels: dict[str, Any] = {"slot_kind": "gpu", "engine_role": "rollout", "instance": f"{slot}-{os.getpid()}"}
    if mode == "standin":
        role: dict[str, Any] = {}

        def generate(args: Any, ctx: Any) -> dict[str, Any]:
            return {"token_ids": [1], "logprobs": [0.0], "finish_reason": "length", "weights_version": 0,
                    "gen_tokens": 1, "group": dict(role), "actor": ctx.actor_id}

        def reconfigure(kinds: list[str], config: dict[str, Any]) -> int:
            role.clear()
            role.update({k: config.get(k) for k in ("role", "tp", "group", "rank")})
            return 4

        labels.update({"engine": "stand-in", "max_tp": 2})
        handlers = {("generate", "*"): generate}
        rt = ActorRuntime(url, ActorIdentity(f"h/{slot}", "h", slot, os.getpid(), {"generate": ["default"]}, labels),
                          ["generate"], 4, handlers, heartbeat_s=0.5, reconfigure=reconfigure)
    elif mode == "hf":
        from libra.actors.rollout_role import RolloutRole, attach_kv_reports
        from libra.engines.hf_rollout import HFRolloutEngine

        engine = HFRolloutEngine(arg, max_batch_size=8, kv_cache_bytes=int(os.environ["KV_BUDGET_BYTES"]))
        r = RolloutRole(arg, None, slot, max_batch=8, torch_threads=1, engine=engine, window_s=0.0)
        labels.update({"engine": "hf", "max_tp": 1})
        handlers = {("generate", "*"): r.generate}
        rt = ActorRuntime(url, ActorIdentity(f"h/{slot}", "h", slot, os.getpid(), {"generate": ["default"]}, labels),
                          ["generate"], 8, handlers, heartbeat_s=0.5)
        attach_kv_reports(handlers, rt._post, rt.state)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: rt.stop())
    rt.run()


if __name__ == "__main__":
    main(*sys.argv[1:])
