"""Workload trace format: one agentic-RL trajectory per JSON line.

This module is the single reader and writer of the trace contract in ``docs/trace-format.md``:
:class:`Turn` and :class:`TrajectorySpec` mirror one line, :func:`read_trace` / :func:`parse_trace`
validate a file, :func:`write_trace` writes one. Everything that replays a workload (simulator,
benchmarks, routers' offline profilers) goes through these types, never through raw dicts.

Contracts:

- Unknown fields are ignored, at every level (trajectory, turn, ``elastic``).
- A line that is not JSON, a missing required field, a wrong type or an out-of-range value raises
  :class:`TraceError` whose message names the source, the 1-based line number and the field path
  (``turns[2].status``). A duplicate trajectory id is an error on the second line.
- Every turn but the last ends in a tool call (``tool``, ``tool_seconds``, ``payload_tokens`` and
  ``status`` all present); the last turn has no tool call.
- Integer fields reject floats and booleans; float fields accept integers.
- The dataclasses are frozen; ``demand`` mappings must be treated as read-only.

Derived quantities (token totals, the generated-token position ``p_i`` of each tool return, the
remaining generated tokens after it, the response-token position and remaining response length
(generated + tool-returned tokens), a decode-work proxy) are properties computed from the turns.
No I/O happens outside :func:`read_trace` and :func:`write_trace`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from libra.policies.planner.types import Workload

STATUSES: tuple[str, ...] = ("success", "failure", "timeout")
"""The tool-return execution statuses of the format."""

_TOOL_FIELDS = ("tool", "tool_seconds", "payload_tokens", "status")


class TraceError(ValueError):
    """A trace line (or a directly constructed record) violates the trace contract.

    ``line`` is the 1-based line number when the error came from a file or stream, ``field`` the
    dotted field path (``turns[1].payload_tokens``) when one field is to blame.
    """

    def __init__(
        self, message: str, *, line: int | None = None, field: str | None = None, source: str | None = None
    ) -> None:
        self.reason = message
        self.line = line
        self.field = field
        self.source = source
        where = []
        if source is not None:
            where.append(source)
        if line is not None:
            where.append(f"line {line}")
        prefix = " ".join(where)
        text = message if field is None else f"field {field!r}: {message}"
        super().__init__(f"{prefix}: {text}" if prefix else text)

    def located(self, *, line: int | None, source: str | None) -> TraceError:
        """A copy of this error carrying ``line`` and ``source`` (used when a record came from a file)."""
        return TraceError(self.reason, line=line, field=self.field, source=source)


# ----------------------------------------------------------------------------------------------
# field checks (each raises TraceError naming the field path)


def _int(value: Any, path: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"expected an integer, got {type(value).__name__} {value!r}", field=path)
    if value < minimum:
        raise TraceError(f"must be >= {minimum}, got {value}", field=path)
    return value


def _float(value: Any, path: str, *, minimum: float = 0.0, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"expected a number, got {type(value).__name__} {value!r}", field=path)
    out = float(value)
    if not math.isfinite(out):
        raise TraceError(f"must be finite, got {value!r}", field=path)
    if out < minimum or (maximum is not None and out > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise TraceError(f"must be {bound}, got {value!r}", field=path)
    return out


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise TraceError(f"expected a string, got {type(value).__name__} {value!r}", field=path)
    if not value:
        raise TraceError("must not be empty", field=path)
    return value


def _require(data: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in data:
        raise TraceError("missing required field", field=path)
    return data[key]


# ----------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True, slots=True)
class ElasticSpec:
    """An action's key elastic resource (ARL-Tangram): at most ``max_units`` units of ``resource``.

    ``parallel_fraction`` is Amdahl's ``f``: with ``m`` units the action runs ``1 / ((1-f) + f/m)``
    times faster than with one unit.
    """

    resource: str
    max_units: int
    parallel_fraction: float

    def __post_init__(self) -> None:
        _str(self.resource, "elastic.resource")
        _int(self.max_units, "elastic.max_units", minimum=1)
        _float(self.parallel_fraction, "elastic.parallel_fraction", maximum=1.0)

    def speedup(self, units: int) -> float:
        """``E(m)·m`` for ``m = min(units, max_units)`` under Amdahl's law; raises ValueError if units < 1."""
        if units < 1:
            raise ValueError(f"units must be >= 1, got {units}")
        m = min(units, self.max_units)
        f = self.parallel_fraction
        return 1.0 / ((1.0 - f) + f / m)

    def duration(self, tool_seconds: float, units: int) -> float:
        """Execution time with ``units`` units: ``tool_seconds / (E(m)·m)``."""
        return tool_seconds / self.speedup(units)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the trace format."""
        return {"resource": self.resource, "max_units": self.max_units, "parallel_fraction": self.parallel_fraction}

    @classmethod
    def from_dict(cls, data: Any, path: str = "elastic") -> ElasticSpec:
        """Parse the ``elastic`` object; raises TraceError naming ``path.<field>``."""
        if not isinstance(data, Mapping):
            raise TraceError(f"expected an object, got {type(data).__name__}", field=path)
        return cls(
            resource=_str(_require(data, "resource", f"{path}.resource"), f"{path}.resource"),
            max_units=_int(_require(data, "max_units", f"{path}.max_units"), f"{path}.max_units", minimum=1),
            parallel_fraction=_float(
                _require(data, "parallel_fraction", f"{path}.parallel_fraction"),
                f"{path}.parallel_fraction",
                maximum=1.0,
            ),
        )


def _demand(data: Any, path: str) -> dict[str, float | str]:
    if not isinstance(data, Mapping):
        raise TraceError(f"expected an object, got {type(data).__name__}", field=path)
    out: dict[str, float | str] = {}
    for key, value in data.items():
        if isinstance(value, str):
            out[key] = _str(value, f"{path}.{key}")
        else:
            out[key] = _float(value, f"{path}.{key}")
    return out


@dataclass(frozen=True, slots=True)
class Turn:
    """One model turn: ``gen_tokens`` generated, then (except in the last turn) one tool call.

    A tool-calling turn has all of ``tool``, ``tool_seconds``, ``payload_tokens`` and ``status``; a final
    turn has none of them (nor ``demand``/``elastic``). Construction raises TraceError otherwise.
    """

    gen_tokens: int
    tool: str | None = None
    tool_seconds: float | None = None
    payload_tokens: int | None = None
    status: str | None = None
    demand: Mapping[str, float | str] | None = None
    elastic: ElasticSpec | None = None

    def __post_init__(self) -> None:
        _int(self.gen_tokens, "gen_tokens")
        present = [name for name in _TOOL_FIELDS if getattr(self, name) is not None]
        if present and len(present) != len(_TOOL_FIELDS):
            missing = next(name for name in _TOOL_FIELDS if getattr(self, name) is None)
            raise TraceError(f"missing required field of a tool call (has {', '.join(present)})", field=missing)
        if not present and (self.demand is not None or self.elastic is not None):
            raise TraceError("only a turn with a tool call may carry a demand or elastic", field="tool")
        if present:
            _str(self.tool, "tool")
            _float(self.tool_seconds, "tool_seconds")
            _int(self.payload_tokens, "payload_tokens")
            if self.status not in STATUSES:
                raise TraceError(f"must be one of {', '.join(STATUSES)}, got {self.status!r}", field="status")

    @property
    def has_tool(self) -> bool:
        """Whether this turn ends in a tool call."""
        return self.tool is not None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the trace format (absent optional fields are omitted)."""
        out: dict[str, Any] = {"gen_tokens": self.gen_tokens}
        if self.tool is not None:
            out.update(
                tool=self.tool, tool_seconds=self.tool_seconds, payload_tokens=self.payload_tokens, status=self.status
            )
        if self.demand is not None:
            out["demand"] = dict(self.demand)
        if self.elastic is not None:
            out["elastic"] = self.elastic.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any, path: str = "turn") -> Turn:
        """Parse one turn object; raises TraceError naming ``path.<field>``."""
        if not isinstance(data, Mapping):
            raise TraceError(f"expected an object, got {type(data).__name__}", field=path)
        gen = _int(_require(data, "gen_tokens", f"{path}.gen_tokens"), f"{path}.gen_tokens")
        if data.get("tool") is None:
            extra = [k for k in (*_TOOL_FIELDS[1:], "demand", "elastic") if data.get(k) is not None]
            if extra:
                raise TraceError(f"{extra[0]!r} given but the turn has no 'tool'", field=f"{path}.tool")
            return cls(gen_tokens=gen)
        status = _str(_require(data, "status", f"{path}.status"), f"{path}.status")
        if status not in STATUSES:
            raise TraceError(f"must be one of {', '.join(STATUSES)}, got {status!r}", field=f"{path}.status")
        demand = data.get("demand")
        elastic = data.get("elastic")
        return cls(
            gen_tokens=gen,
            tool=_str(data["tool"], f"{path}.tool"),
            tool_seconds=_float(_require(data, "tool_seconds", f"{path}.tool_seconds"), f"{path}.tool_seconds"),
            payload_tokens=_int(_require(data, "payload_tokens", f"{path}.payload_tokens"), f"{path}.payload_tokens"),
            status=status,
            demand=None if demand is None else _demand(demand, f"{path}.demand"),
            elastic=None if elastic is None else ElasticSpec.from_dict(elastic, f"{path}.elastic"),
        )


def size_class(payload_tokens: int, small_max: int = 1000, medium_max: int = 12000) -> str:
    """The C-MLFQ payload size class: ``small`` if <= small_max, ``medium`` if <= medium_max, else ``large``.

    The defaults are the R2E thresholds of Libra's config (1000/12000).
    """
    if payload_tokens <= small_max:
        return "small"
    if payload_tokens <= medium_max:
        return "medium"
    return "large"


@dataclass(frozen=True, slots=True)
class TrajectorySpec:
    """One trajectory of a trace: its identity, prompt size and turns (see the module contract)."""

    id: str
    prompt_id: str
    step: int
    group: str
    prompt_tokens: int
    turns: tuple[Turn, ...]

    def __post_init__(self) -> None:
        for name in ("id", "prompt_id", "group"):
            _str(getattr(self, name), name)
        _int(self.step, "step")
        _int(self.prompt_tokens, "prompt_tokens")
        if not isinstance(self.turns, tuple):
            object.__setattr__(self, "turns", tuple(self.turns))
        if not self.turns:
            raise TraceError("must hold at least one turn", field="turns")
        for i, turn in enumerate(self.turns):
            last = i == len(self.turns) - 1
            if not last and not turn.has_tool:
                raise TraceError("every turn but the last must end in a tool call", field=f"turns[{i}].tool")
            if last and turn.has_tool:
                raise TraceError("the last turn must not end in a tool call", field=f"turns[{i}].tool")

    # -- derived quantities ---------------------------------------------------------------------

    @property
    def num_turns(self) -> int:
        """Number of model turns."""
        return len(self.turns)

    @property
    def num_tool_calls(self) -> int:
        """Number of tool calls (``num_turns - 1``)."""
        return len(self.turns) - 1

    @property
    def tool_turns(self) -> tuple[Turn, ...]:
        """The turns that end in a tool call, in order (the i-th is the i-th tool return)."""
        return self.turns[:-1]

    @property
    def num_failures(self) -> int:
        """Tool calls whose status is ``failure`` or ``timeout``."""
        return sum(1 for t in self.tool_turns if t.status != "success")

    @property
    def total_gen_tokens(self) -> int:
        """Σ generated tokens over all turns (the trajectory's output length)."""
        return sum(t.gen_tokens for t in self.turns)

    @property
    def total_payload_tokens(self) -> int:
        """Σ tool-returned tokens."""
        return sum(t.payload_tokens or 0 for t in self.turns)

    @property
    def total_tokens(self) -> int:
        """Final sequence length: prompt + generated + tool-returned tokens."""
        return self.prompt_tokens + self.total_gen_tokens + self.total_payload_tokens

    @property
    def tool_return_positions(self) -> tuple[int, ...]:
        """``p_i``: generated tokens so far when the i-th tool call returns (one entry per tool call)."""
        out, acc = [], 0
        for t in self.tool_turns:
            acc += t.gen_tokens
            out.append(acc)
        return tuple(out)

    @property
    def remaining_gen_after_returns(self) -> tuple[int, ...]:
        """``total_gen_tokens - p_i`` for each tool return: what the C-MLFQ prefix tree learns."""
        total = self.total_gen_tokens
        return tuple(total - p for p in self.tool_return_positions)

    @property
    def total_response_tokens(self) -> int:
        """Σ generated + Σ tool-returned tokens: the response length (everything after the prompt).

        This is the length C-MLFQ's buckets are sized on: their ``max_tokens`` thresholds and the
        40,960-token model cap count the whole sequence an instance serves, tool observations included
        (docs/papers.md §1.4.1, §1.5), not only the decoded tokens.
        """
        return self.total_gen_tokens + self.total_payload_tokens

    @property
    def response_positions(self) -> tuple[int, ...]:
        """Response tokens (generated + tool-returned) once the i-th tool return is in the context."""
        out, acc = [], 0
        for t in self.tool_turns:
            acc += t.gen_tokens + (t.payload_tokens or 0)
            out.append(acc)
        return tuple(out)

    @property
    def remaining_response_after_returns(self) -> tuple[int, ...]:
        """``total_response_tokens`` minus :attr:`response_positions`: the true remaining length at each
        tool return (what routing accuracy is scored against and what the prefix tree learns)."""
        total = self.total_response_tokens
        return tuple(total - p for p in self.response_positions)

    @property
    def context_before_turns(self) -> tuple[int, ...]:
        """Context length (prompt + all earlier generated and returned tokens) when each turn starts."""
        out, ctx = [], self.prompt_tokens
        for t in self.turns:
            out.append(ctx)
            ctx += t.gen_tokens + (t.payload_tokens or 0)
        return tuple(out)

    @property
    def decode_work(self) -> int:
        """Σ over turns and decoded tokens of the context each token attends to (a rollout-time proxy).

        A turn that decodes ``g`` tokens from context ``c`` costs ``g·c + g·(g-1)/2``.
        """
        work = 0
        for t, ctx in zip(self.turns, self.context_before_turns):
            g = t.gen_tokens
            work += g * ctx + g * (g - 1) // 2
        return work

    def tool_states(self, small_max: int = 1000, medium_max: int = 12000) -> tuple[tuple[str, str, str], ...]:
        """``(tool, size_class, status)`` of each tool return, in order (the C-MLFQ causal signal)."""
        return tuple(
            (t.tool or "", size_class(t.payload_tokens or 0, small_max, medium_max), t.status or "")
            for t in self.tool_turns
        )

    # -- (de)serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of one trace line."""
        return {
            "id": self.id,
            "prompt_id": self.prompt_id,
            "step": self.step,
            "group": self.group,
            "prompt_tokens": self.prompt_tokens,
            "turns": [t.to_dict() for t in self.turns],
        }

    @classmethod
    def from_dict(cls, data: Any) -> TrajectorySpec:
        """Parse one trace object; raises TraceError naming the field path (no line number)."""
        if not isinstance(data, Mapping):
            raise TraceError(f"expected a JSON object, got {type(data).__name__}")
        ident = _str(_require(data, "id", "id"), "id")
        prompt_id = _str(_require(data, "prompt_id", "prompt_id"), "prompt_id")
        step = _int(_require(data, "step", "step"), "step")
        group = _str(_require(data, "group", "group"), "group")
        prompt_tokens = _int(_require(data, "prompt_tokens", "prompt_tokens"), "prompt_tokens")
        turns_raw = _require(data, "turns", "turns")
        if not isinstance(turns_raw, list):
            raise TraceError(f"expected a list, got {type(turns_raw).__name__}", field="turns")
        turns = tuple(Turn.from_dict(t, f"turns[{i}]") for i, t in enumerate(turns_raw))
        return cls(id=ident, prompt_id=prompt_id, step=step, group=group, prompt_tokens=prompt_tokens, turns=turns)


# ----------------------------------------------------------------------------------------------
# files


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> Iterator[TrajectorySpec]:
    """Yield the trajectories of JSON-Lines text, validating each line.

    Blank lines are skipped. Raises TraceError with ``line`` set (1-based) on the first bad line,
    including a trajectory id already seen on an earlier line.
    """
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"not valid JSON ({exc.msg} at column {exc.colno})", line=lineno, source=source) from None
        try:
            traj = TrajectorySpec.from_dict(data)
        except TraceError as exc:
            raise exc.located(line=lineno, source=source) from None
        if traj.id in seen:
            raise TraceError(
                f"duplicate trajectory id {traj.id!r} (first on line {seen[traj.id]})",
                line=lineno,
                field="id",
                source=source,
            )
        seen[traj.id] = lineno
        yield traj


def read_trace(path: str | os.PathLike[str]) -> list[TrajectorySpec]:
    """Read and validate a JSON-Lines trace file; raises TraceError naming the line and field."""
    with open(path, encoding="utf-8") as fh:
        return list(parse_trace(fh, source=os.fspath(path)))


def write_trace(dest: str | os.PathLike[str] | TextIO, trajectories: Iterable[TrajectorySpec]) -> int:
    """Write trajectories as JSON Lines (one compact object per line) to a path or text stream.

    Returns the number of lines written. A path is overwritten.
    """

    def _write(fh: TextIO) -> int:
        n = 0
        for traj in trajectories:
            fh.write(json.dumps(traj.to_dict(), separators=(",", ":")))
            fh.write("\n")
            n += 1
        return n

    if isinstance(dest, (str, os.PathLike)):
        with open(dest, "w", encoding="utf-8") as fh:
            return _write(fh)
    return _write(dest)


def tool_seconds_of(t: TrajectorySpec) -> float:
    """Seconds trajectory ``t`` waits on its tool calls (the simulator's tool actor takes each call's
    ``tool_seconds``)."""
    return float(sum(x.tool_seconds or 0.0 for x in t.turns))


def workload_of(trajs: Sequence[TrajectorySpec]) -> Workload:
    """Planner workload of trajectories: (prompt + tool payload, generated tokens, generate turns, tool
    seconds) each."""
    return Workload.from_pairs((t.prompt_tokens + t.total_payload_tokens, max(1, t.total_gen_tokens), t.num_turns,
                                tool_seconds_of(t)) for t in trajs)
