"""Contexts stay on the rollout instance: an EpisodeSession sends deltas to real RolloutRoles (tiny model) whose
contexts move over real data-plane servers when a trajectory migrates, in both modes (KV transfer and
re-prefill), with the same tokens and log-probs as without migration; wrong contexts fail typed."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from libra.actors.rollout_role import RolloutRole
from libra.actors.tools import ToolError
from libra.client import ToolFailed
from libra.dataplane import DataPlaneServer
from libra.engines.tiny_model import ensure_tiny_model
from libra.protocol.payloads_job import EpisodeSampling
from libra.protocol.payloads_rollout import (
    EMPTY_DIGEST,
    GenerateArgs,
    GenerateResult,
    TurnContext,
    context_digest,
    ids_object,
)
from libra.rl.episode import EpisodeSession

_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def roles(model_dir):
    rs = [RolloutRole(str(model_dir), None, f"cpu{i}", max_batch=4, window_s=0.0) for i in range(2)]
    yield rs
    for r in rs:
        r.close()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class FakeBroker:
    """Routes turn ``t`` to ``plan[t] = (role index, Assign.route mode)``, as the broker's Assign would, and
    maps a role's ToolError to the client's ToolFailed."""

    def __init__(self, roles, plan) -> None:
        self.roles, self.plan, self.turn, self.args = roles, plan, 0, []

    async def request(self, kind, name, args, trajectory, timeout=None):
        i, mode = self.plan[min(self.turn, len(self.plan) - 1)]
        self.turn += 1
        self.args.append(args)
        ctx = SimpleNamespace(trajectory=trajectory, route={"bucket": name, "mode": mode}, work_id=f"w{self.turn}")
        try:
            out = await asyncio.to_thread(self.roles[i].generate, args, ctx)
        except ToolError as exc:
            raise ToolFailed(exc.message, tool_code=exc.code) from None
        return SimpleNamespace(output=out)


def run_episode(roles, tokenizer, plan, *, server=None, delta=True, turns=4, before_turn=None):
    params = EpisodeSampling(max_new_tokens=6, temperature=1.0, max_total_tokens=1000)
    broker = FakeBroker(roles, plan)
    prompt = tokenizer.encode("<|im_start|>user\nwhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n")
    s = EpisodeSession(broker, tokenizer, f"traj-{next(_ids)}", prompt, params, lambda: None, [1], seed=7,
                       context_server=server, delta=delta)

    async def go():
        for t in range(turns):
            if before_turn is not None:
                before_turn(t, s)
            await s.generate()
            s.add_user(f"tool output {t}: 42")

    asyncio.run(go())
    return s, broker


def test_sticky_turns_send_deltas_and_hit_the_instance_cache(roles, tokenizer) -> None:
    s, broker = run_episode(roles, tokenizer, [(0, None)])
    assert s.context_via == ["new", "cache", "cache", "cache"]
    whole, _ = run_episode(roles, tokenizer, [(1, None)], delta=False)
    assert whole.context_via == ["full"] * 4
    assert s.input_ids == whole.input_ids and s.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    # the broker carries the new tokens only: later turns do not grow with the context
    assert all("prompt_ids" not in a for a in broker.args)
    assert [len(a["context"]["new_ids"]) for a in broker.args[1:]] == [len(a["context"]["new_ids"])
                                                                        for a in broker.args[1:2]] * 3
    assert whole.turn_bytes[-1] - whole.turn_bytes[1] > 40  # the whole form grows with every turn ...
    assert abs(s.turn_bytes[-1] - s.turn_bytes[1]) <= 8  # ... the delta form does not


@pytest.mark.parametrize("mode", ["kv", "reprefill"])
def test_a_migrated_trajectory_continues_exactly_as_without_migration(roles, tokenizer, mode) -> None:
    with DataPlaneServer() as server:
        still, _ = run_episode(roles, tokenizer, [(0, None)], server=server)
        moved, _ = run_episode(roles, tokenizer, [(0, None), (0, None), (1, mode), (1, None)], server=server)
    assert moved.input_ids == still.input_ids
    assert moved.logprobs == pytest.approx(still.logprobs, abs=1e-4)
    assert moved.context_via == ["new", "cache", "kv" if mode == "kv" else "ids", "cache"]


def test_a_long_prompt_goes_over_the_data_plane_from_the_first_turn(roles, tokenizer) -> None:
    with DataPlaneServer() as server:
        def shrink(t, s):
            s.inline_tokens = 8  # the prompt counts as long

        still, _ = run_episode(roles, tokenizer, [(0, None)], turns=2)
        s, broker = run_episode(roles, tokenizer, [(0, None)], server=server, turns=2, before_turn=shrink)
    first = broker.args[0]["context"]
    assert first["new_ids"] == [] and first["prefix_len"] == first["total_len"] > 8
    assert s.context_via == ["ids", "cache"]
    assert s.input_ids == still.input_ids and s.logprobs == pytest.approx(still.logprobs, abs=1e-4)


def test_re_prefill_takes_the_ids_from_the_previous_instance_without_a_session_server(roles, tokenizer) -> None:
    moved, _ = run_episode(roles, tokenizer, [(0, None), (1, "reprefill")], turns=3)
    assert moved.context_via == ["new", "ids", "cache"]


def test_a_context_nobody_holds_is_sent_whole_once(roles, tokenizer) -> None:
    def evict(t, s):
        if t == 2:
            roles[0].engine.kv_cache.drop(s.trajectory)  # A lost it, and no session server to fetch it from

    still, _ = run_episode(roles, tokenizer, [(0, None)])
    s, broker = run_episode(roles, tokenizer, [(0, None)], before_turn=evict)
    assert s.context_via == ["new", "cache", "full", "cache"]
    assert "prompt_ids" in broker.args[3] and "prompt_ids" not in broker.args[4]  # turn 2 failed, then resent
    assert s.input_ids == still.input_ids


def gen_args(ctx: TurnContext) -> dict:
    return GenerateArgs(context=ctx, max_new_tokens=2, temperature=0.0).to_wire()


def call(role, args, traj="bad", mode=None):
    return role.generate(args, SimpleNamespace(trajectory=traj, route={"mode": mode}, work_id="w"))


def test_a_context_that_does_not_match_its_digest_is_never_generated_from(roles) -> None:
    ids = [5, 6, 7, 8]
    with DataPlaneServer() as server:
        ref = server.publish("ctx/bad", *ids_object([5, 6, 9, 8]))  # the source holds another context
        src = {"endpoint": ref.endpoint, "name": ref.name}
        ctx = TurnContext.from_wire({"new_ids": [1], "prefix_len": 4, "prefix_digest": context_digest(ids),
                                     "total_len": 5, "digest": context_digest([*ids, 1]), "source": src})
        with pytest.raises(ToolError) as err:
            call(roles[1], gen_args(ctx))
        assert err.value.code == "context_mismatch"
    # a whole context whose digest is not the turn's: refused too
    wrong = TurnContext(new_ids=[1, 2], prefix_len=0, prefix_digest=EMPTY_DIGEST, total_len=2,
                        digest=context_digest([1, 3]))
    with pytest.raises(ToolError) as err:
        call(roles[1], gen_args(wrong))
    assert err.value.code == "context_mismatch"
    # not held, nothing named to fetch it from
    lost = TurnContext(new_ids=[1], prefix_len=4, prefix_digest=context_digest(ids), total_len=5,
                       digest=context_digest([*ids, 1]))
    with pytest.raises(ToolError) as err:
        call(roles[1], gen_args(lost), traj="nobody")
    assert err.value.code == "context_missing"
    with pytest.raises(ToolError) as err:  # the delta form needs a trajectory to key the context by
        call(roles[1], gen_args(lost), traj=None)
    assert err.value.code == "bad_request"


def test_the_reply_names_where_the_context_is_held(roles) -> None:
    ctx = TurnContext(new_ids=[2, 3, 4], prefix_len=0, prefix_digest=EMPTY_DIGEST, total_len=3,
                      digest=context_digest([2, 3, 4]))
    out = GenerateResult.from_wire(call(roles[0], gen_args(ctx), traj="named"))
    assert out.context_at is not None and out.context_at.name == "ctx/named"
    assert out.context_at.endpoint == roles[0].contexts.server.endpoint
    assert out.context_via == "new" and out.prefill_tokens == 3


class PlainEngine:
    """An engine without a context cache of its own (as vLLM, whose prefix cache is internal): it records the
    whole prompts it is given."""

    weights_version = 0

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def generate(self, reqs):
        from libra.engines.rollout_base import GenResult

        self.prompts += [list(r.prompt_ids) for r in reqs]
        return [GenResult(token_ids=[9, 8], logprobs=[-1.0, -1.0], finish_reason="length", weights_version=0,
                          num_prompt_tokens=len(r.prompt_ids)) for r in reqs]


def test_engines_without_a_cache_get_whole_prompts_and_their_ids_can_move() -> None:
    from libra.actors.rollout_context import ContextService, Turn
    from libra.engines.rollout_base import GenRequest

    a, b = ContextService(PlainEngine()), ContextService(PlainEngine())
    try:
        def turn(svc, ctx, mode=None):
            prompt, via = svc.resolve("t", GenerateArgs(context=ctx, max_new_tokens=2), {"mode": mode})
            t = Turn(GenRequest(prompt_ids=prompt, max_new_tokens=2), "t", via)
            (r,) = svc.generate([t])
            return via, svc.reply_fields(t, r)["context_at"]

        first = TurnContext(new_ids=[5, 6], prefix_len=0, prefix_digest=EMPTY_DIGEST, total_len=2,
                            digest=context_digest([5, 6]))
        via, at = turn(a, first)
        held = [5, 6, 9, 8]
        second = TurnContext(new_ids=[7], prefix_len=4, prefix_digest=context_digest(held), total_len=5,
                             digest=context_digest([*held, 7]), holder=at)
        assert via == "new" and turn(a, second)[0] == "cache"
        assert a.engine.prompts == [[5, 6], [*held, 7]]  # the engine always sees the whole prompt
        # moved to b with mode kv: a holds no KV to give, so b takes the ids instead
        held2 = [*held, 7, 9, 8]
        third = TurnContext(new_ids=[4], prefix_len=7, prefix_digest=context_digest(held2), total_len=8,
                            digest=context_digest([*held2, 4]), holder=at)
        assert turn(b, third, "kv")[0] == "ids" and b.stats["kv_fetch_failed"] == 0
        assert b.engine.prompts == [[*held2, 4]]
    finally:
        a.close()
        b.close()


def test_a_failed_kv_transfer_falls_back_to_the_session_ids() -> None:
    from libra.actors.rollout_context import ContextService

    ids = [3, 4, 5]
    gone = DataPlaneServer()
    dead = {"endpoint": gone.endpoint, "name": "ctx/t"}
    gone.close()  # the previous instance died
    svc = ContextService(PlainEngine(), fetch_timeout_s=0.5)
    try:
        with DataPlaneServer() as session_side:
            ref = session_side.publish("ctx/t", *ids_object([*ids, 6]))
            ctx = TurnContext.from_wire({"new_ids": [6], "prefix_len": 3, "prefix_digest": context_digest(ids),
                                         "total_len": 4, "digest": context_digest([*ids, 6]), "holder": dead,
                                         "source": {"endpoint": ref.endpoint, "name": ref.name}})
            prompt, via = svc.resolve("t", GenerateArgs(context=ctx), {"mode": "kv"})
        assert (prompt, via) == ([*ids, 6], "ids") and svc.stats["kv_fetch_failed"] == 1
    finally:
        svc.close()
