"""Trace format: parsing, validation errors that name the line and field, round trips, derived lengths."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from libra.traces import (
    ElasticSpec,
    TraceError,
    TrajectorySpec,
    Turn,
    parse_trace,
    read_trace,
    size_class,
    write_trace,
)

README_EXAMPLE = {
    "id": "t-000123",
    "prompt_id": "p-0042",
    "step": 3,
    "group": "p-0042@3",
    "prompt_tokens": 812,
    "turns": [
        {
            "gen_tokens": 420,
            "tool": "bash",
            "tool_seconds": 1.2,
            "payload_tokens": 900,
            "status": "success",
            "demand": {"cpu": 1},
            "elastic": {"resource": "cpu", "max_units": 8, "parallel_fraction": 0.7},
        },
        {"gen_tokens": 615, "tool": "python", "tool_seconds": 0.4, "payload_tokens": 14000, "status": "failure"},
        {"gen_tokens": 300},
    ],
}


def _line(**overrides: object) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(README_EXAMPLE))
    data.update(overrides)
    return data


def _parse(*objs: object) -> list[TrajectorySpec]:
    lines = [o if isinstance(o, str) else json.dumps(o) for o in objs]
    return list(parse_trace(lines, source="mem.jsonl"))


def test_readme_example_parses_with_all_fields() -> None:
    (traj,) = _parse(README_EXAMPLE)
    assert traj.id == "t-000123" and traj.group == "p-0042@3" and traj.step == 3
    first, second, last = traj.turns
    assert first.tool == "bash" and first.status == "success" and first.demand == {"cpu": 1.0}
    assert first.elastic == ElasticSpec("cpu", 8, 0.7)
    assert second.payload_tokens == 14000 and second.demand is None and second.elastic is None
    assert not last.has_tool and last.gen_tokens == 300


def test_derived_lengths_of_readme_example() -> None:
    (traj,) = _parse(README_EXAMPLE)
    assert traj.total_gen_tokens == 420 + 615 + 300
    assert traj.total_payload_tokens == 900 + 14000
    assert traj.total_tokens == 812 + 1335 + 14900
    assert traj.tool_return_positions == (420, 1035)
    assert traj.remaining_gen_after_returns == (1335 - 420, 1335 - 1035)
    assert traj.context_before_turns == (812, 812 + 420 + 900, 812 + 420 + 900 + 615 + 14000)
    expected_work = sum(g * c + g * (g - 1) // 2 for g, c in zip((420, 615, 300), traj.context_before_turns))
    assert traj.decode_work == expected_work
    assert traj.num_tool_calls == 2 and traj.num_failures == 1
    assert traj.tool_states() == (("bash", "small", "success"), ("python", "large", "failure"))
    assert traj.tool_states(small_max=500, medium_max=15000) == (
        ("bash", "medium", "success"),
        ("python", "medium", "failure"),
    )


def test_size_class_boundaries_are_inclusive() -> None:
    assert [size_class(n) for n in (0, 1000, 1001, 12000, 12001)] == ["small", "small", "medium", "medium", "large"]


def test_round_trip_through_file_and_stream(tmp_path: Path) -> None:
    trajs = _parse(README_EXAMPLE, _line(id="t-2", turns=[{"gen_tokens": 5}]))
    path = tmp_path / "trace.jsonl"
    assert write_trace(path, trajs) == 2
    assert read_trace(path) == trajs
    buf = io.StringIO()
    write_trace(buf, trajs)
    assert list(parse_trace(buf.getvalue().splitlines())) == trajs
    # Absent optional fields stay absent on the wire.
    assert "demand" not in json.loads(buf.getvalue().splitlines()[0])["turns"][1]


def test_unknown_fields_are_ignored_at_every_level() -> None:
    data = _line(extra="x", reward=1.0)
    data["turns"][0]["note"] = "hi"
    data["turns"][0]["elastic"]["profile"] = [1, 2]
    data["turns"][2]["logprobs"] = None
    (traj,) = _parse(data)
    assert traj == _parse(README_EXAMPLE)[0]


def test_blank_lines_are_skipped_and_line_numbers_stay_true() -> None:
    bad = _line(id="t-9")
    del bad["prompt_tokens"]
    with pytest.raises(TraceError) as err:
        _parse(README_EXAMPLE, "", "   ", bad)
    assert err.value.line == 4 and err.value.field == "prompt_tokens"
    assert "mem.jsonl line 4" in str(err.value) and "prompt_tokens" in str(err.value)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("id"), "id"),
        (lambda d: d.pop("turns"), "turns"),
        (lambda d: d.update(step="3"), "step"),
        (lambda d: d.update(step=True), "step"),
        (lambda d: d.update(prompt_tokens=-1), "prompt_tokens"),
        (lambda d: d.update(group=""), "group"),
        (lambda d: d.update(turns={"gen_tokens": 1}), "turns"),
        (lambda d: d.update(turns=[]), "turns"),
        (lambda d: d["turns"][0].update(gen_tokens=1.5), "turns[0].gen_tokens"),
        (lambda d: d["turns"][0].pop("gen_tokens"), "turns[0].gen_tokens"),
        (lambda d: d["turns"][1].pop("status"), "turns[1].status"),
        (lambda d: d["turns"][1].update(status="ok"), "turns[1].status"),
        (lambda d: d["turns"][1].pop("tool_seconds"), "turns[1].tool_seconds"),
        (lambda d: d["turns"][1].update(tool_seconds="fast"), "turns[1].tool_seconds"),
        (lambda d: d["turns"][1].update(payload_tokens=None), "turns[1].payload_tokens"),
        (lambda d: d["turns"][0]["elastic"].pop("max_units"), "turns[0].elastic.max_units"),
        (lambda d: d["turns"][0]["elastic"].update(parallel_fraction=1.5), "turns[0].elastic.parallel_fraction"),
        (lambda d: d["turns"][0].update(demand={"cpu": -2}), "turns[0].demand.cpu"),
        (lambda d: d["turns"][0].update(demand=[1]), "turns[0].demand"),
        (lambda d: d["turns"][2].update(status="success"), "turns[2].tool"),
        (lambda d: d["turns"][1].pop("tool"), "turns[1].tool"),
        (
            lambda d: d["turns"][2].update(tool="bash", tool_seconds=1, payload_tokens=1, status="success"),
            "turns[2].tool",
        ),
    ],
)
def test_bad_field_names_line_and_field(mutate: Callable[[dict[str, Any]], object], field: str) -> None:
    data = _line(id="t-bad")
    mutate(data)
    with pytest.raises(TraceError) as err:
        _parse(README_EXAMPLE, data)
    assert err.value.line == 2
    assert err.value.field == field
    assert "line 2" in str(err.value) and repr(field) in str(err.value)


def test_invalid_json_and_non_object_lines() -> None:
    with pytest.raises(TraceError, match=r"line 2: not valid JSON"):
        _parse(README_EXAMPLE, '{"id": ')
    with pytest.raises(TraceError, match=r"line 1: expected a JSON object, got list"):
        _parse("[1, 2]")


def test_duplicate_id_is_an_error_on_the_second_line() -> None:
    with pytest.raises(TraceError) as err:
        _parse(README_EXAMPLE, _line(), README_EXAMPLE)
    assert err.value.line == 2 and "first on line 1" in str(err.value)


def test_read_trace_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(README_EXAMPLE) + "\n" + json.dumps(_line(id="t-2", step=-1)) + "\n")
    with pytest.raises(TraceError, match=r"broken\.jsonl line 2: field 'step': must be >= 0"):
        read_trace(path)


def test_direct_construction_enforces_the_same_contract() -> None:
    with pytest.raises(TraceError, match="status"):
        Turn(gen_tokens=3, tool="bash", tool_seconds=1.0, payload_tokens=2)
    with pytest.raises(TraceError, match="demand or elastic"):
        Turn(gen_tokens=3, demand={"cpu": 1})
    with pytest.raises(TraceError, match="every turn but the last"):
        TrajectorySpec("t", "p", 0, "g", 1, (Turn(1), Turn(2)))
    traj = TrajectorySpec("t", "p", 0, "g", 1, [Turn(1)])  # type: ignore[arg-type]  # frozen into a tuple
    assert traj.turns == (Turn(1),) and traj.tool_return_positions == () and traj.decode_work == 1 * 1 + 0


def test_elastic_amdahl_speedup_and_duration() -> None:
    spec = ElasticSpec("cpu", 8, 0.75)
    assert spec.speedup(1) == pytest.approx(1.0)
    assert spec.speedup(4) == pytest.approx(1 / (0.25 + 0.75 / 4))
    assert spec.speedup(64) == spec.speedup(8)  # capped at max_units
    assert spec.duration(10.0, 2) == pytest.approx(10.0 * (0.25 + 0.375))
    with pytest.raises(ValueError, match="units must be >= 1"):
        spec.speedup(0)


def test_response_lengths_of_readme_example() -> None:
    """Response tokens count tool payloads too; a tool return's response position includes its payload."""
    (traj,) = _parse(README_EXAMPLE)
    assert traj.total_response_tokens == 1335 + 14900
    assert traj.response_positions == (420 + 900, 420 + 900 + 615 + 14000)
    assert traj.remaining_response_after_returns == (615 + 14000 + 300, 300)
