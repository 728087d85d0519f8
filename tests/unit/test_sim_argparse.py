"""The simulator's and the benchmarks' command lines take no abbreviations: ``python -m libra.sim --workload
coding --batch N`` used to read ``--batch`` as ``--batching`` (argparse's prefix matching) instead of handing
it to the action simulator; now every parser in libra/sim and libra/bench is built with
``allow_abbrev=False``, so an option is matched only by its full name."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from libra.sim import __main__ as sim_main

ROOT = Path(__file__).resolve().parents[2]
PARSER_FILES = ["libra/sim/__main__.py", "libra/sim/actions_sim.py", "libra/sim/workloads.py",
                *(f"libra/bench/{n}.py" for n in (
                    "ablation", "actions", "actions_sched", "broker", "calibration", "chaos", "dataplane", "engines",
                    "metrics", "overload", "payloads", "placement", "planner", "planner_accuracy", "planner_round",
                    "prefix_cache", "rollout", "router_state", "routing", "sandbox", "trainer"))]


def test_batch_is_not_read_as_batching_and_goes_to_the_action_simulator(capsys) -> None:
    args, extra = sim_main.build_parser().parse_known_args(["--workload", "coding", "--batch", "16"])
    assert args.batching == "streaming" and extra == ["--batch", "16"]
    assert sim_main.main(["--workload", "coding", "--batch", "16", "--steps", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["batch"] == 16


def test_a_prefix_of_an_option_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        sim_main.main(["--workload", "r2e", "--plan-sear", "3"])  # neither --plan-search nor --plan-search-s
    assert exc.value.code == 2 and "--plan-sear" in capsys.readouterr().err


@pytest.mark.parametrize("path", PARSER_FILES)
def test_every_simulator_and_benchmark_parser_turns_abbreviations_off(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "ArgumentParser"]
    assert calls, f"{path}: no ArgumentParser"
    for c in calls:
        kw = {k.arg: k.value for k in c.keywords}
        assert isinstance(kw.get("allow_abbrev"), ast.Constant) and kw["allow_abbrev"].value is False, path
