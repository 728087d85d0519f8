"""Benchmark: typed work payloads (``libra.protocol.payloads_*``) vs today's hand-built dicts, at the boundary.

Two payloads, each through the real codec (``encode`` → ``decode`` of the message that carries it) and the
receiver's validation, in the same run:

- a ``generate`` turn: ``Submit`` whose args hold a long prompt (``--prompt`` token ids, 4096 by default),
  sampling settings, stop ids, a seed and a weights ref. Baseline: the sender builds the dict by hand and
  the rollout actor checks it the way it did before the structs (isinstance checks, ``int()``/``float()``
  of every field and every token id, the weights ref's shape). Typed: the sender builds
  :class:`GenerateArgs` and calls ``to_wire()``; the actor calls ``GenerateArgs.from_wire``.
- a tool call: ``Submit`` of ``python`` args (code, timeout, two files) and the ``WorkResult`` of its reply
  (stdout, stderr, exit code). Baseline: the sandbox's own argument checks
  (``libra.engines.sandbox.tools``) and isinstance checks of the reply's fields. Typed: ``PythonArgs`` and
  ``ToolResult`` ``from_wire``. The sandbox keeps its own checks (limits, paths) in both cases, so this row
  compares what a caller or the broker pays to validate the payload, not the sandbox's total.

An extra row shows msgspec decoding the generate args straight from msgpack bytes into the struct (no
intermediate dict), which the codec does not do today. Prints µs per payload and typed/baseline ratios.

``python -m libra.bench payloads [--prompt 4096] [--iters 2000] [--json]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

from libra.bench.output import emit
from libra.protocol import decode, encode
from libra.protocol import messages as m
from libra.protocol.payloads import GenerateArgs, PythonArgs, ToolResult, WeightsRef

__all__ = ["main", "run"]

KEY = "rq:}[z5(q$R4UH{ZEn8(8M}[BuYb<@Ax8[A)=yPf"
WEIGHTS = {"version": 7, "endpoint": "tcp://10.0.0.2:7000", "name": "weights", "server_key": KEY, "bytes": 1 << 28}


def _today_generate(args: Any) -> tuple[Any, ...]:
    """The checks the rollout actor made before the structs (RolloutRole.generate and _maybe_load)."""
    if not isinstance(args, dict) or not isinstance(args.get("prompt_ids"), list):
        raise ValueError("generate needs args {'prompt_ids': [int, ...], ...}")
    prompt = [int(t) for t in args["prompt_ids"]]
    w = args.get("weights")
    weights = w if (isinstance(w, dict) and type(w.get("version")) is int
                    and (isinstance(w.get("endpoint"), str) or isinstance(w.get("path"), str))) else None
    return (prompt, int(args.get("max_new_tokens", 32)), float(args.get("temperature", 1.0)),
            float(args.get("top_p", 1.0)), [int(t) for t in args.get("stop_token_ids") or []],
            args.get("seed") if isinstance(args.get("seed"), int) else None, weights)


def _today_tool_args(args: Any) -> Any:
    from libra.engines.sandbox.errors import SandboxLimits
    from libra.engines.sandbox.tools import _check_keys, _text_arg, _timeout, validate_files

    limits = _LIMITS.setdefault("l", SandboxLimits())
    _check_keys("python", args, ("code", "files", "timeout_s"))
    code = _text_arg("python", args, "code")
    return code, _timeout("python", args, limits), validate_files("python", args.get("files"), 1 << 20)


_LIMITS: dict[str, Any] = {}


def _today_tool_result(out: Any) -> Any:
    if not (isinstance(out, dict) and isinstance(out.get("stdout"), str) and isinstance(out.get("stderr"), str)
            and (out.get("exit_code") is None or type(out.get("exit_code")) is int)):
        raise ValueError("bad tool result")
    return out


def _per_op_us(fn: Callable[[], Any], iters: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / iters * 1e6


def run(prompt: int, iters: int) -> dict[str, Any]:
    import msgpack
    import msgspec

    ids = [(i * 7919) % 50_000 for i in range(prompt)]
    gen_fields = {"max_new_tokens": 512, "temperature": 0.8, "top_p": 0.95, "stop_token_ids": [2, 151645],
                  "seed": 1234, "prompt_id": "p-0123456789abcdef", "prompt_tokens": prompt}

    def gen_today() -> Any:
        args = {"prompt_ids": ids, **gen_fields, "weights": WEIGHTS}
        got = decode(encode(m.Submit("r1", "generate", "default", args, "traj-1", 0.0))).msg
        return _today_generate(got.args)

    def gen_typed() -> Any:
        args = GenerateArgs(prompt_ids=ids, weights=WeightsRef.from_wire(WEIGHTS), **gen_fields).to_wire()
        got = decode(encode(m.Submit("r1", "generate", "default", args, "traj-1", 0.0))).msg
        return GenerateArgs.from_wire(got.args)

    direct = msgspec.msgpack.Decoder(GenerateArgs)
    wire_args = GenerateArgs(prompt_ids=ids, weights=WeightsRef.from_wire(WEIGHTS), **gen_fields).to_wire()
    packed = msgpack.packb(wire_args, use_bin_type=True)

    def gen_direct() -> Any:
        return direct.decode(packed)

    code = "import math\n" + "\n".join(f"print(math.sqrt({i}))" for i in range(40))
    tool_args = {"code": code, "timeout_s": 10.0, "files": {"data/in.txt": "1 2 3\n" * 50, "conf.json": "{}"}}
    tool_out = {"stdout": "\n".join(str(i ** 0.5) for i in range(40)), "stderr": "", "exit_code": 0,
                "truncated": {"stdout": False, "stderr": False}, "duration_s": 0.031}

    def tool_today() -> Any:
        got = decode(encode(m.Submit("r2", "action", "python", dict(tool_args), "traj-1", 0.0))).msg
        _today_tool_args(got.args)
        res = decode(encode(m.WorkResult("w2", 1, True, dict(tool_out)))).msg
        return _today_tool_result(res.output)

    def tool_typed() -> Any:
        args = PythonArgs(code=code, timeout_s=10.0, files=tool_args["files"]).to_wire()
        got = decode(encode(m.Submit("r2", "action", "python", args, "traj-1", 0.0))).msg
        PythonArgs.from_wire(got.args)
        res = decode(encode(m.WorkResult("w2", 1, True, ToolResult.from_wire(tool_out).to_wire()))).msg
        return ToolResult.from_wire(res.output)

    assert GenerateArgs.from_wire(wire_args).prompt_ids == _today_generate(wire_args)[0] == direct.decode(packed).prompt_ids
    t0 = time.perf_counter()
    rows = {
        "generate_today_us": _per_op_us(gen_today, iters),
        "generate_typed_us": _per_op_us(gen_typed, iters),
        "generate_msgspec_direct_us": _per_op_us(gen_direct, iters),
        "tool_today_us": _per_op_us(tool_today, iters * 4),
        "tool_typed_us": _per_op_us(tool_typed, iters * 4),
    }
    out: dict[str, Any] = {"prompt_ids": prompt, "iters": iters, **{k: round(v, 2) for k, v in rows.items()}}
    out["generate_ratio_typed_over_today"] = round(rows["generate_typed_us"] / rows["generate_today_us"], 3)
    out["generate_ratio_direct_over_today"] = round(rows["generate_msgspec_direct_us"] / rows["generate_today_us"], 3)
    out["tool_ratio_typed_over_today"] = round(rows["tool_typed_us"] / rows["tool_today_us"], 3)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def _fmt(o: dict[str, Any]) -> str:
    return "\n".join([
        f"payload boundary cost (encode + decode + validate), {o['prompt_ids']} prompt ids, best of 3 x {o['iters']}",
        f"  generate args  today (dict + hand checks)  {o['generate_today_us']:>9.2f} us",
        f"                 typed (GenerateArgs)        {o['generate_typed_us']:>9.2f} us   "
        f"ratio typed/today {o['generate_ratio_typed_over_today']:.3f}",
        f"                 msgspec straight from bytes {o['generate_msgspec_direct_us']:>9.2f} us   "
        f"ratio {o['generate_ratio_direct_over_today']:.3f} (args only, not the codec path)",
        f"  python tool    today (sandbox checks)      {o['tool_today_us']:>9.2f} us",
        f"  call + reply   typed (PythonArgs/ToolResult){o['tool_typed_us']:>8.2f} us   "
        f"ratio typed/today {o['tool_ratio_typed_over_today']:.3f}",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench payloads", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=4096, help="prompt token ids in the generate args (default 4096)")
    p.add_argument("--iters", type=int, default=2000, help="iterations per timing (default 2000)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    emit(run(a.prompt, a.iters), a.json, _fmt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
