"""The arith environment's shifting workload: ``max_new_tokens_ramp`` / ``ramp_rows`` give each problem a turn
cap that grows over the rows; rows carry it, episodes ask for it, bad values are named."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from libra.envs import arith
from libra.envs.contract import OptionsError


def test_the_cap_grows_linearly_over_the_ramp_rows_and_stays_at_the_end() -> None:
    caps = [arith.ramp_tokens(i, [8, 64], 8) for i in range(12)]
    assert caps[0] == 8 and caps[7] == 64 and caps[8:] == [64] * 4
    assert caps == sorted(caps) and len(set(caps[:8])) == 8
    assert arith.ramp_tokens(3, [40, 10], 4) == 10  # a ramp may shrink too
    flat = [arith.ramp_tokens(i, [4, 24], 8, from_row=3) for i in range(9)]
    assert flat == [4, 4, 4, 4, 9, 14, 19, 24, 24]


def test_problems_carry_their_cap_through_rows_and_the_same_problems_without_a_ramp() -> None:
    plain = arith.make_problems(6, seed=3)
    ramped = arith.make_problems(6, seed=3, max_new_tokens_ramp=[4, 24], ramp_rows=6)
    assert [p.question for p in plain] == [p.question for p in ramped]  # the ramp draws no random numbers
    assert [p.max_new_tokens for p in plain] == [0] * 6
    assert [p.max_new_tokens for p in ramped] == [4, 8, 12, 16, 20, 24]
    late = arith.make_problems(6, seed=3, max_new_tokens_ramp=[4, 24], ramp_rows=6, ramp_from_row=2)
    assert [p.max_new_tokens for p in late] == [4, 4, 4, 11, 17, 24]
    rows = [arith.to_row(p) for p in ramped]
    assert "max_new_tokens" not in arith.to_row(plain[0]) and rows[5]["max_new_tokens"] == 24
    assert [arith.from_row(r) for r in rows] == ramped


def test_the_options_validate_with_the_key_named() -> None:
    o = arith.validate_options({"max_new_tokens_ramp": [8, 64], "ramp_rows": 16, "ramp_from_row": 14})
    assert o["max_new_tokens_ramp"] == [8, 64] and o["ramp_rows"] == 16 and o["ramp_from_row"] == 14
    assert arith.validate_options({})["max_new_tokens_ramp"] == []
    bad = [({"max_new_tokens_ramp": [8]}, "max_new_tokens_ramp"), ({"max_new_tokens_ramp": [0, 8]}, "max_new_tokens_ramp"),
           ({"max_new_tokens_ramp": [8, 9.5], "ramp_rows": 4}, "max_new_tokens_ramp"),
           ({"max_new_tokens_ramp": "8,64"}, "max_new_tokens_ramp"),
           ({"max_new_tokens_ramp": [8, 64]}, "ramp_rows"), ({"max_new_tokens_ramp": [8, 64], "ramp_rows": 1}, "ramp_rows"),
           ({"ramp_rows": 4}, "ramp_rows"), ({"max_new_tokens_ramp": [8, 64], "ramp_rows": -2}, "ramp_rows"),
           ({"max_new_tokens_ramp": [8, 64], "ramp_rows": 8, "ramp_from_row": 7}, "ramp_from_row"),
           ({"max_new_tokens_ramp": [8, 64], "ramp_rows": 8, "ramp_from_row": -1}, "ramp_from_row"),
           ({"ramp_from_row": 2}, "ramp_from_row")]
    for options, key in bad:
        with pytest.raises(OptionsError) as err:
            arith.validate_options(options)
        assert err.value.key == key and key in str(err.value), options
    with pytest.raises(ValueError, match="ramp_rows"):
        arith.make_problems(2, max_new_tokens_ramp=[8, 64])


class _Session:
    def __init__(self) -> None:
        self.caps: list[int | None] = []
        self.versions = [0]
        self.tool_calls = 0

    async def generate(self, max_new_tokens: int | None = None) -> str:
        self.caps.append(max_new_tokens)
        return "Answer: 3"


def test_an_episode_asks_for_its_problems_cap_and_a_plain_one_for_the_jobs() -> None:
    cfg = SimpleNamespace(max_turns=2, options={})
    p = arith.Problem("p", "q", 3, max_new_tokens=17)
    s = _Session()
    reward, _ = asyncio.run(arith.episode(s, p, cfg))
    assert s.caps == [17] and reward > 1.0
    s = _Session()
    asyncio.run(arith.episode(s, arith.Problem("p", "q", 3), cfg))
    assert s.caps == [None]
