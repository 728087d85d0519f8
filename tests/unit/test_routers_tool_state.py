"""Tool-return state extraction (C-MLFQ's causal signal): size classes, status rules, tool names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libra.policies.routing.tool_state import (
    DEFAULT_THRESHOLDS,
    R2E_THRESHOLDS,
    SizeThresholds,
    ToolStateError,
    execution_status,
    extract_tool_state,
    payload_size,
    size_class,
)


@pytest.mark.parametrize(
    ("size", "thresholds", "expected"),
    [
        (0, DEFAULT_THRESHOLDS, "small"),
        (500, DEFAULT_THRESHOLDS, "small"),
        (501, DEFAULT_THRESHOLDS, "medium"),
        (5000, DEFAULT_THRESHOLDS, "medium"),
        (5001, DEFAULT_THRESHOLDS, "large"),
        (1000, R2E_THRESHOLDS, "small"),
        (1001, R2E_THRESHOLDS, "medium"),
        (12000, R2E_THRESHOLDS, "medium"),
        (12001, R2E_THRESHOLDS, "large"),
    ],
)
def test_size_class_boundaries(size: int, thresholds: SizeThresholds, expected: str) -> None:
    assert size_class(size, thresholds) == expected


@given(st.integers(min_value=0, max_value=100_000), st.integers(min_value=0, max_value=100_000))
def test_size_class_is_monotone_in_size(a: int, b: int) -> None:
    order = {"small": 0, "medium": 1, "large": 2}
    lo, hi = sorted((a, b))
    assert order[size_class(lo)] <= order[size_class(hi)]


def test_payload_tokens_win_over_characters() -> None:
    text = "x" * 800  # 800 characters: medium by characters
    assert extract_tool_state("bash", text).size == "medium"
    assert extract_tool_state("bash", text, payload_tokens=120).size == "small"
    assert extract_tool_state("bash", {"stdout": "y" * 10, "payload_tokens": 9000}).size == "large"
    # A mapping counts the characters of its values, not of its keys.
    assert payload_size({"stdout": "abc", "stderr": "", "exit_code": 0}) == 4
    assert payload_size(None, payload_chars=77) == 77


def test_key_format() -> None:
    state = extract_tool_state("python", "All good", thresholds=R2E_THRESHOLDS)
    assert state.key == "python:small:success"


@pytest.mark.parametrize(
    ("output", "status", "expected"),
    [
        ("Traceback: ValueError: bad", None, "failure"),
        ("ERROR: no such file", None, "failure"),
        ("3 tests passed", None, "success"),
        ({"stdout": "", "stderr": "NameError: x", "exit_code": 1}, None, "failure"),
        ({"stdout": "ok", "error": None}, None, "success"),  # a null error key is no error
        ({"result": 1, "traceback": "File x, line 2"}, None, "failure"),
        ({"result": 1, "exception": "boom"}, None, "failure"),
        ({"status": "Failed"}, None, "failure"),
        ({"status": "timed_out"}, None, "timeout"),
        ({"status": "timeout"}, None, "timeout"),
        ({"status": "timeout", "stderr": "error: killed"}, None, "failure"),  # failure rules come first
        ({"status": "ok", "stdout": "fine"}, None, "success"),
        ("compile error in foo.c", "success", "success"),  # an explicit status is authoritative
        ("", "timed-out", "timeout"),
        ("", "FAILED", "failure"),
    ],
)
def test_execution_status_rules(output: object, status: str | None, expected: str) -> None:
    assert execution_status(output, status=status) == expected


def test_unknown_explicit_status_is_an_error() -> None:
    with pytest.raises(ToolStateError, match="unknown tool status: 'weird'"):
        execution_status("x", status="weird")


def test_tool_type_defaults_and_validation() -> None:
    assert extract_tool_state(None, "raw text").tool == "text"
    assert extract_tool_state(None, {"tool": "search", "content": "..."}).tool == "search"
    with pytest.raises(ToolStateError, match="must not contain ':'"):
        extract_tool_state("a:b", "x")
    with pytest.raises(ToolStateError, match="non-empty"):
        extract_tool_state("  ", "x")


def test_bad_thresholds_and_sizes() -> None:
    with pytest.raises(ToolStateError, match="small < medium"):
        SizeThresholds(5000, 500)
    with pytest.raises(ToolStateError, match="payload_tokens"):
        extract_tool_state("bash", "x", payload_tokens=-3)
    with pytest.raises(ToolStateError, match="non-negative"):
        size_class(-1)
