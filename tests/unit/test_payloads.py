"""Typed work payloads (libra.protocol.payloads_*): every struct round-trips through its wire mapping, every
required field and type error is a PayloadError naming the field, the broker reads route hints leniently,
and a rollout actor handed malformed generate args answers with a bad_request failure instead of crashing."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from libra.protocol import decode, encode
from libra.protocol import messages as m
from libra.protocol.payloads import (
    BashArgs,
    DataRef,
    EpisodeArgs,
    EpisodeResult,
    EpisodeSampling,
    EpisodeSpec,
    GenerateArgs,
    GenerateResult,
    JobPollReply,
    OracleHints,
    PayloadError,
    PytestArgs,
    PytestResult,
    PytestSummary,
    PythonArgs,
    RouteHints,
    ToolResult,
    TrainArgs,
    TrainPart,
    TrainResult,
    WeightsRef,
)

KEY = "k" * 40
REF = {"endpoint": "tcp://127.0.0.1:5555", "name": "traj/j/g0/1/w7", "version": None, "server_key": None,
       "bytes": 4096}
WREF = {"version": 3, "endpoint": "tcp://10.0.0.2:7000", "name": "weights", "server_key": KEY, "bytes": 1 << 20}
GEN = {"prompt_ids": [1, 2, 3], "max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": [0],
       "seed": 11, "weights": WREF, "prompt_id": "p-1", "prompt_tokens": 3, "step": 2}

# (struct, a full wire mapping): to_wire(from_wire(wire)) == wire
ROUND_TRIPS = [
    (DataRef, REF),
    (DataRef, {**REF, "version": 4, "server_key": KEY}),
    (WeightsRef, WREF),
    (WeightsRef, {"version": 5, "transport": "torch", "backend": "gloo", "endpoint": "tcp://h:1", "name": "weights/v5",
                  "server_key": None, "bytes": 10}),
    (WeightsRef, {"version": 4, "path": "/ck/v4.libra", "endpoint": None, "name": None, "server_key": None,
                  "bytes": 0}),
    (GenerateArgs, GEN),
    (GenerateArgs, {"prompt_ids": [5], "max_new_tokens": 32, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [],
                    "weights": None}),
    (GenerateResult, {"token_ids": [4, 0], "logprobs": [-0.1, -2.0], "finish_reason": "stop", "weights_version": 3,
                      "gen_tokens": 2, "load_s": 0.5, "fetch_s": 0.25, "weights_via": "dataplane",
                      "weights_error": None, "batch": 4}),
    (RouteHints, {"prompt_id": "p", "prompt_tokens": 7, "step": 1}),
    (OracleHints, {"prompt_id": None, "prompt_tokens": None, "step": None, "true_remaining": 900}),
    (TrainPart, {"ref": REF, "advantage": -0.5, "index": 3}),
    (TrainArgs, {"parts": [[{"ref": REF, "advantage": 1.0, "index": 0}], [{"ref": REF, "advantage": -1.0, "index": 1}]],
                 "micro_batches": [[[0]], [[0]]], "world_size": 2, "rank": 1, "master_port": 29500, "step": 1,
                 "grpo": {"lr": 1e-5, "clip_low": [0.2, 0.3]}, "checkpoint": None}),
    (TrainArgs, {"shards": [REF], "world_size": 1, "rank": 0, "master_port": 0, "grpo": {}, "checkpoint": "/ck/s1"}),
    (TrainResult, {"rank": 0, "metrics": {"loss": 0.1, "grad_norm": 2.0}, "weights_version": 1, "checksum": "ab" * 32,
                   "weights": WREF, "publish_s": 0.01, "shard_sequences": 4, "shard_tokens": 40, "shard_fetch_s": 0.1,
                   "shard_bytes": 800, "shard_sources": 2, "checkpoint": "/ck/s1"}),
    (EpisodeSampling, {"max_new_tokens": 8, "temperature": 0.5, "top_p": 0.95, "max_total_tokens": 512,
                       "timeout_s": 30.0}),
    (EpisodeSpec, {"env_config": {"name": "arith"}, "sampling": {"max_new_tokens": 8}, "model_dir": "/m"}),
    (EpisodeSpec, {}),
    (EpisodeArgs, {"row": {"question": "1+1", "answer": 2}, "job": "j", "group": 4, "index": 1, "seed": 99,
                   "episode": {"sampling": {"max_new_tokens": 8}}}),
    (EpisodeResult, {"reward": 1.0, "versions": [0, 1], "gen_tokens": 12, "tokens": 40, "ref": REF,
                     "info": {"correct": True, "texts": ["a"]}}),
    (JobPollReply, {"job": "j", "state": "running", "error": "", "steps": 3, "steps_done": 1, "version": 1,
                    "weights": WREF, "records": [{"step": 1}], "next_cursor": 1, "dropped_groups": 0,
                    "episodes_failed": 0, "episodes_running": 6, "training": True}),
    (PythonArgs, {"code": "print(1)", "timeout_s": 5.0, "files": {"a.txt": "x", "b.bin": b"\x00"}}),
    (PythonArgs, {"code": "print(1)"}),
    (BashArgs, {"command": "ls", "timeout_s": 2.5}),
    (PytestArgs, {"args": ["-q"], "workers": 2, "files": {"test_a.py": "def test(): pass"}}),
    (PytestArgs, {}),
    (ToolResult, {"stdout": "1\n", "stderr": "", "exit_code": 0, "truncated": {"stdout": False}, "duration_s": 0.2,
                  "killed": None}),
    (ToolResult, {"stdout": "x" * 8, "stderr": "", "exit_code": -9, "truncated": {"stdout": True}, "duration_s": 0.2,
                  "killed": "output_limit"}),
    (PytestSummary, {"passed": 3, "failed": 1, "errors": 0, "skipped": 2}),
    (PytestResult, {"stdout": "", "stderr": "", "exit_code": 1, "truncated": {}, "duration_s": 1.0, "killed": None,
                    "summary": {"passed": 3, "failed": 1, "errors": 0, "skipped": 0}, "workers": 2}),
]


@pytest.mark.parametrize(("cls", "wire"), ROUND_TRIPS, ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_every_struct_round_trips_through_its_wire_mapping(cls: type, wire: dict) -> None:
    obj = cls.from_wire(wire)
    assert isinstance(obj, cls)
    assert obj.to_wire() == wire
    assert cls.from_wire(obj.to_wire()) == obj
    # ... and through the real codec, inside the message that carries it
    back = decode(encode(m.Submit("r1", "generate", "default", obj.to_wire(), "t1", 0.0))).msg
    assert cls.from_wire(back.args) == obj


def test_defaults_fill_in_and_optional_fields_stay_off_the_wire() -> None:
    g = GenerateArgs.from_wire({"prompt_ids": [1]})
    assert (g.max_new_tokens, g.temperature, g.top_p, g.stop_token_ids, g.seed, g.weights) == (32, 1.0, 1.0, [], None,
                                                                                                None)
    assert g.to_wire() == {"prompt_ids": [1], "max_new_tokens": 32, "temperature": 1.0, "top_p": 1.0,
                           "stop_token_ids": [], "weights": None}
    assert GenerateArgs.from_wire({"prompt_ids": [1], "temperature": 1}).temperature == 1.0  # an int is a float
    assert EpisodeArgs(row={"q": 1}).to_wire() == {"row": {"q": 1}, "job": "job", "seed": 0, "episode": {}}
    assert TrainArgs(shards=[DataRef.from_wire(REF)]).to_wire()["shards"] == [REF]
    assert "parts" not in TrainArgs(shards=[DataRef.from_wire(REF)]).to_wire()


def test_the_simulator_field_is_not_part_of_the_runtime_schema() -> None:
    args = {"prompt_ids": [1, 2], "prompt_id": "p", "prompt_tokens": 2, "step": 0, "true_remaining": 500}
    g = GenerateArgs.from_wire(args)
    assert not hasattr(g, "true_remaining") and "true_remaining" not in g.to_wire()
    assert "true_remaining" not in GenerateArgs.__struct_fields__
    assert OracleHints.from_args(args).true_remaining == 500  # what the broker's oracle router reads
    assert RouteHints.from_args(args) == RouteHints(prompt_id="p", prompt_tokens=2, step=0)


@pytest.mark.parametrize("args", [None, "x", [], {"prompt_id": 3, "prompt_tokens": -1, "step": "2",
                                                  "true_remaining": True}])
def test_route_hints_never_raise_and_read_bad_hints_as_absent(args: object) -> None:
    assert OracleHints.from_args(args) == OracleHints()


# (struct, wire, the field the error names, a phrase of its message)
ERRORS = [
    (GenerateArgs, {"max_new_tokens": 3}, "prompt_ids", "exactly one of `prompt_ids`"),
    (GenerateArgs, {"prompt_ids": []}, "prompt_ids", "length >= 1"),
    (GenerateArgs, {"prompt_ids": "1 2"}, "prompt_ids", "Expected `array | null`, got `str`"),
    (GenerateArgs, {"prompt_ids": [1, "2"]}, "prompt_ids[1]", "Expected `int`, got `str`"),
    (GenerateArgs, {"prompt_ids": [1, -2]}, "prompt_ids[1]", ">= 0"),
    (GenerateArgs, {"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens", ">= 1"),
    (GenerateArgs, {"prompt_ids": [1], "max_new_tokens": 2.5}, "max_new_tokens", "Expected `int`, got `float`"),
    (GenerateArgs, {"prompt_ids": [1], "max_new_tokens": True}, "max_new_tokens", "got `bool`"),
    (GenerateArgs, {"prompt_ids": [1], "temperature": -0.1}, "temperature", ">= 0.0"),
    (GenerateArgs, {"prompt_ids": [1], "temperature": float("inf")}, "temperature", "finite"),
    (GenerateArgs, {"prompt_ids": [1], "temperature": "hot"}, "temperature", "Expected `float`, got `str`"),
    (GenerateArgs, {"prompt_ids": [1], "top_p": 0.0}, "top_p", "> 0.0"),
    (GenerateArgs, {"prompt_ids": [1], "top_p": 1.5}, "top_p", "<= 1.0"),
    (GenerateArgs, {"prompt_ids": [1], "stop_token_ids": [3, -1]}, "stop_token_ids[1]", ">= 0"),
    (GenerateArgs, {"prompt_ids": [1], "stop_token_ids": None}, "stop_token_ids", "got `null`"),
    (GenerateArgs, {"prompt_ids": [1], "seed": 1.0}, "seed", "Expected `int | null`, got `float`"),
    (GenerateArgs, {"prompt_ids": [1], "weights": {"endpoint": "tcp://h:1"}}, "weights.version",
     "missing required field"),
    (GenerateArgs, {"prompt_ids": [1], "weights": {"version": "3", "endpoint": "tcp://h:1"}}, "weights.version",
     "Expected `int`, got `str`"),
    (GenerateArgs, {"prompt_ids": [1], "weights": {"version": 3}}, "weights.endpoint", "needs an endpoint"),
    (GenerateArgs, {"prompt_ids": [1], "weights": {"version": 3, "endpoint": "tcp://h:1", "server_key": "short"}},
     "weights.server_key", "40 Z85 characters"),
    (GenerateArgs, {"prompt_ids": [1], "prompt_id": 5}, "prompt_id", "Expected `str | null`, got `int`"),
    (GenerateArgs, [1, 2, 3], "", "Expected `object`, got `array`"),
    (GenerateResult, {"logprobs": [], "finish_reason": "stop", "weights_version": 0, "gen_tokens": 0}, "token_ids",
     "missing required field"),
    (GenerateResult, {"token_ids": [1], "logprobs": [], "finish_reason": "stop", "weights_version": 0,
                      "gen_tokens": 1}, "logprobs", "0 log-probs for 1 tokens"),
    (GenerateResult, {"token_ids": [1], "logprobs": [-1.0], "finish_reason": "stop", "weights_version": "0",
                      "gen_tokens": 1}, "weights_version", "Expected `int`, got `str`"),
    (DataRef, {"name": "x"}, "endpoint", "missing required field"),
    (DataRef, {"endpoint": "http://h:1", "name": "x"}, "endpoint", "tcp://, ipc:// or inproc://"),
    (DataRef, {"endpoint": "tcp://h:1", "name": ""}, "name", "length >= 1"),
    (DataRef, {"endpoint": "tcp://h:1", "name": "x", "bytes": -1}, "bytes", ">= 0"),
    (DataRef, {"endpoint": "tcp://h:1", "name": "x", "version": "1"}, "version", "Expected `int | null`"),
    (TrainArgs, {}, "shards", "train needs `parts`"),
    (TrainArgs, {"parts": [], "shards": []}, "shards", "train needs `parts`"),
    (TrainArgs, {"shards": [REF], "world_size": 0}, "world_size", ">= 1"),
    (TrainArgs, {"shards": [REF], "world_size": 2, "rank": 2}, "rank", "not below world_size"),
    (TrainArgs, {"shards": [{**REF, "endpoint": 5}]}, "shards[0].endpoint", "Expected `str`, got `int`"),
    (TrainArgs, {"parts": [[{"ref": REF}]]}, "parts[0][0].advantage", "missing required field"),
    (TrainArgs, {"parts": [[{"ref": REF, "advantage": "high"}]]}, "parts[0][0].advantage", "Expected `float`"),
    (TrainArgs, {"shards": [REF], "micro_batches": [[[0, -1]]]}, "micro_batches[0][0][1]", ">= 0"),
    (TrainArgs, {"shards": [REF], "grpo": []}, "grpo", "Expected `object`, got `array`"),
    (TrainArgs, {"shards": [REF], "checkpoint": 1}, "checkpoint", "Expected `str | null`, got `int`"),
    (TrainResult, {"rank": 0, "metrics": {}, "weights_version": 1}, "checksum", "missing required field"),
    (EpisodeArgs, {"group": 1}, "row", "missing required field"),
    (EpisodeArgs, {"row": "1+1"}, "row", "Expected `object`, got `str`"),
    (EpisodeArgs, {"row": {}, "group": -1}, "group", ">= 0"),
    (EpisodeArgs, {"row": {}, "seed": "7"}, "seed", "Expected `int`, got `str`"),
    (EpisodeArgs, {"row": {}, "episode": {"sampling": {"max_new_tokens": 0}}}, "episode.sampling.max_new_tokens",
     ">= 1"),
    (EpisodeArgs, {"row": {}, "episode": {"sampling": {"temprature": 0.5}}}, "episode.sampling.temprature",
     "unknown field"),
    (EpisodeArgs, {"row": {}, "episode": {"env_config": 3}}, "episode.env_config", "Expected `object`"),
    (EpisodeResult, {"reward": 1.0, "versions": [0], "gen_tokens": 1, "tokens": 2}, "ref", "missing required field"),
    (EpisodeResult, {"reward": "1", "versions": [0], "gen_tokens": 1, "tokens": 2, "ref": REF}, "reward",
     "Expected `float`, got `str`"),
    (EpisodeResult, {"reward": 1.0, "versions": [0], "gen_tokens": 1, "tokens": 2, "ref": {**REF, "name": None}},
     "ref.name", "Expected `str`, got `null`"),
    (JobPollReply, {"state": "done"}, "job", "missing required field"),
    (JobPollReply, {"job": "j", "state": "done", "records": {}}, "records", "Expected `array`, got `object`"),
    (PythonArgs, {}, "code", "missing required field"),
    (PythonArgs, {"code": 1}, "code", "Expected `str`, got `int`"),
    (PythonArgs, {"code": "x", "timeout_s": 0}, "timeout_s", "> 0.0"),
    (PythonArgs, {"code": "x", "files": {"a": 1}}, "files", "content of 'a' must be text or bytes"),
    (PythonArgs, {"code": "x", "cwd": "/"}, "cwd", "unknown field"),
    (BashArgs, {"cmd": "ls"}, "cmd", "unknown field"),
    (BashArgs, {}, "command", "missing required field"),
    (PytestArgs, {"workers": 0}, "workers", ">= 1"),
    (PytestArgs, {"args": "-q"}, "args", "Expected `array`, got `str`"),
    (ToolResult, {"stdout": "", "stderr": ""}, "exit_code", "missing required field"),
    (PytestResult, {"stdout": "", "stderr": "", "exit_code": 0, "summary": {"passed": -1}}, "summary.passed", ">= 0"),
]


@pytest.mark.parametrize(("cls", "wire", "field", "phrase"), ERRORS)
def test_every_required_field_and_type_error_names_the_field(cls: type, wire: object, field: str, phrase: str) -> None:
    with pytest.raises(PayloadError) as info:
        cls.from_wire(wire)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == field and err.payload == cls.WHAT
    assert phrase in str(err) and str(err).startswith(f"bad {cls.WHAT}: ")
    if field:
        assert f"`{field}`" in str(err)


def test_error_messages_read_well() -> None:
    with pytest.raises(PayloadError, match=r"^bad generate args: `max_new_tokens`: Expected `int` >= 1$"):
        GenerateArgs.from_wire({"prompt_ids": [1], "max_new_tokens": 0})
    with pytest.raises(PayloadError, match=r"^bad train args: `rank`: 3 is not below world_size 2$"):
        TrainArgs.from_wire({"shards": [REF, REF], "world_size": 2, "rank": 3})


# ------------------------------------------------------------------------- the rollout actor's boundary
@pytest.fixture(scope="module")
def rollout_role():
    from libra.actors.rollout_role import RolloutRole
    from libra.engines.tiny_model import ensure_tiny_model

    if os.environ.get("LIBRA_ROLLOUT_ENGINE", "hf") != "hf":
        pytest.skip("needs the hf rollout engine")
    role = RolloutRole(str(ensure_tiny_model()), None, "cpu5", max_batch=2, window_s=0.0)
    yield role
    role.close()


MALFORMED = [
    ({"max_new_tokens": 3}, "prompt_ids"),
    (["not", "a", "mapping"], "Expected `object`"),
    ({"prompt_ids": [1, "x"]}, "prompt_ids[1]"),
    ({"prompt_ids": [1], "max_new_tokens": "8"}, "max_new_tokens"),
    ({"prompt_ids": [1], "top_p": 2.0}, "top_p"),
    ({"prompt_ids": [1], "weights": {"version": "v2", "endpoint": "tcp://127.0.0.1:1"}}, "weights.version"),
]


@pytest.mark.parametrize(("args", "needle"), MALFORMED)
def test_rollout_actor_answers_malformed_generate_args_with_bad_request(rollout_role, args: object,
                                                                        needle: str) -> None:
    from libra.actors.runtime import ActorRuntime
    from libra.actors.state import ActorIdentity
    from libra.actors.tools import ToolError, WorkContext

    ctx = WorkContext("w1", "t1", 60.0, threading.Event(), "test")
    with pytest.raises(ToolError) as info:
        rollout_role.generate(args, ctx)
    assert info.value.code == "bad_request" and needle in info.value.message
    assert info.value.message.startswith("bad generate args")
    # through the actor runtime: a failed WorkDone with the typed code, not a tool crash
    rt = ActorRuntime("tcp://127.0.0.1:1", ActorIdentity("a1", "h", "cpu5", os.getpid(), {"generate": ["*"]}),
                      ["generate"], 1, {("generate", "*"): rollout_role.generate})
    try:
        done = rt._call("w1", 1, "default", args, "t1", rollout_role.generate, ctx)
    finally:
        rt.ctx.term()
    assert not done.ok and done.error_code == "bad_request" and needle in done.error
    # the instance still serves well-formed turns
    out = GenerateResult.from_wire(rollout_role.generate({"prompt_ids": [5, 6], "max_new_tokens": 2, "seed": 1}, ctx))
    assert out.gen_tokens == len(out.token_ids) <= 2 and out.weights_version == 0


def test_train_role_and_episode_role_refuse_malformed_args(tmp_path: Path) -> None:
    from libra.actors.episode_role import EpisodeRole
    from libra.actors.tools import ToolError, WorkContext
    from libra.actors.train_role import TrainRole
    from libra.engines.tiny_model import ensure_tiny_model

    ctx = WorkContext("w1", "t1", 60.0, threading.Event(), "test")
    role = TrainRole(str(ensure_tiny_model()), str(tmp_path), "cpu4")
    for bad, needle in (({}, "`shards`"), ({"shards": [{"endpoint": "x", "name": "b"}]}, "shards[0].endpoint"),
                        ({"shards": [REF], "world_size": "2"}, "world_size")):
        with pytest.raises(ToolError) as info:
            role.train(bad, ctx)
        assert info.value.code == "bad_request" and needle in info.value.message
    assert role.trainer is None  # nothing was created for a refused work
    role.close()
    runner = EpisodeRole("tcp://127.0.0.1:1", None, "cpu3")
    try:
        for bad, needle in (({"group": 1}, "`row`"), ({"row": {}, "episode": {"sampling": {"top_k": 5}}},
                                                      "episode.sampling.top_k")):
            with pytest.raises(ToolError) as info:
                runner.episode(bad, ctx)
            assert info.value.code == "bad_request" and needle in info.value.message
    finally:
        runner.close()


# ------------------------------------------------------------------------- the broker's job host
def test_job_host_builds_typed_work_and_refuses_a_bad_episode_spec() -> None:
    from libra.broker.job_host import JobHost, JobSpec
    from libra.config import ConfigError

    spec = {"steps": 1, "prompts_per_step": 1, "group_size": 2, "max_policy_lag": 0, "world_size": 2, "env": "arith",
            "episode": {"sampling": {"max_new_tokens": 8}, "model_dir": "/m"}, "master_port": 29500}
    h = JobHost("j", JobSpec.from_mapping(spec), [{"question": "1+1", "answer": 2}], 0.0)
    eps = h.take_work(0.0)
    assert [EpisodeArgs.from_wire(w.args).episode.sampling.max_new_tokens for w in eps] == [8, 8]
    assert all(w.args["episode"] == spec["episode"] for w in eps)  # handed to runners as the job file wrote it
    for k, w in enumerate(eps):
        out = {"reward": float(k), "versions": [0], "gen_tokens": 3, "tokens": 9, "ref": {**REF, "name": f"t{k}"}}
        h.on_reply(w.tag, True, out, "", 1.0)
    trains = h.take_work(1.0)
    assert [w.kind for w in trains] == ["train", "train"]
    parsed = [TrainArgs.from_wire(w.args) for w in trains]
    assert [a.rank for a in parsed] == [0, 1] and all(a.world_size == 2 for a in parsed)
    assert sorted(p.ref.name for a in parsed[:1] for rank in a.parts for p in rank) == ["t0", "t1"]
    with pytest.raises(ConfigError, match=r"job spec: bad episode spec: `sampling.temprature`: Object contains unknown field"):
        JobHost("j", JobSpec.from_mapping({**spec, "episode": {"sampling": {"temprature": 1.0}}}), [{}], 0.0)


def test_job_host_counts_a_malformed_episode_reply_as_a_failed_episode() -> None:
    from libra.broker.job_host import JobHost, JobSpec

    spec = {"steps": 1, "prompts_per_step": 1, "group_size": 2, "max_policy_lag": 0, "world_size": 1, "env": "arith"}
    h = JobHost("j", JobSpec.from_mapping(spec), [{"question": "1+1", "answer": 2}], 0.0)
    first, _ = h.take_work(0.0)
    h.on_reply(first.tag, True, {"reward": 1.0, "versions": [0], "gen_tokens": 3, "tokens": 9,
                                 "ref": {**REF, "endpoint": "http://x"}}, "", 1.0)
    assert h.episodes_failed == 1
