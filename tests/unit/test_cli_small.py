"""The small things of the command line (#28 item 9): ``libra bench --list`` exits 0 even when its reader
stops early, usage lines name the command as it was run, ``libra --version``, help text for every ``sim``
option, ``plan --help`` whole, and ``libra status`` showing the router's figures as lines, not a dict."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from libra.cli import build_parser, main
from libra.commands.status import format_status


def test_bench_list_exits_0_even_when_the_reader_closes_the_pipe_first() -> None:
    r, w = os.pipe()
    os.close(r)  # like `libra bench --list | head -1` after head has gone: every write fails (EPIPE)
    try:
        out = subprocess.run([sys.executable, "-m", "libra", "bench", "--list"], stdout=w, stderr=subprocess.PIPE,
                             text=True, timeout=120)
    finally:
        os.close(w)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-800:]


def test_bench_list_prints_the_list_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: libra bench NAME") and "chaos" in text.split()


@pytest.mark.parametrize("argv, usage", [
    (["--help"], "usage: libra "), (["status", "--help"], "usage: libra status "),
    (["plan", "--help"], "usage: libra plan "), (["broker", "--help"], "usage: libra broker "),
    (["actors", "--help"], "usage: libra actors "), (["sim", "--help"], "usage: libra sim "),
    (["serve", "--help"], "usage: libra serve "),
])
def test_usage_lines_say_libra_under_the_console_script(argv: list[str], usage: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)  # what the `libra` console script (libra.cli:main) runs
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_python_dash_m_libra_says_python_dash_m_libra() -> None:
    out = subprocess.run([sys.executable, "-m", "libra", "broker", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m libra broker "), out.stdout[:200]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"libra {version('libra')}"


def test_every_sim_option_has_help_text() -> None:
    from libra.sim.__main__ import build_parser as sim_parser

    bare = [a.option_strings[0] for a in sim_parser()._actions if a.option_strings and not a.help]
    assert not bare, f"sim options without help text: {bare}"
    assert "cmlfq" in next(a.help for a in sim_parser()._actions if "--router" in a.option_strings)


def test_plan_help_shows_the_whole_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "would deploy for a logged workload, without a broker." in text
    assert "Exits 0 on success, 1 when the trace cannot be read" in text


def test_status_prints_router_stats_as_readable_lines_not_a_dict() -> None:
    stats = {"submitted": 5, "completed": 4,
             "router": {"router": "cmlfq", "steps": 3, "active_trajectories": 2, "tree_prompts": 12,
                        "tree_rebuilds": 1, "hit_rate": 0.41234},
             "jobs": {"arith": {"state": "running", "steps_done": 2, "steps": 8}},
             "actions": {"scheduler": "tangram", "running": 2,
                         "cores": {"h/cpu0": {"pool": "h", "cores": 4, "free": 1, "held_by": 2}}, "services": {}},
             "leases": [{"lease": 1, "done": 3, "failed": 1}, {"lease": 2, "done": 4, "failed": 0}]}
    text = format_status([], {}, stats)
    assert "{" not in text and "'" not in text, text  # no Python repr of a dict or a list
    lines = text.splitlines()
    assert "submitted=5  completed=4" in lines
    assert "ROUTER cmlfq: steps=3, active_trajectories=2, tree_prompts=12, tree_rebuilds=1, hit_rate=0.412" in lines
    assert "JOB arith: state=running, steps_done=2, steps=8" in lines
    assert "ACTIONS tangram: running=2, cores free=1/4 on 1 actor(s), services=-" in lines
    assert "DIRECT LEASES 2: calls done=7, failed=1" in lines


def test_the_top_parser_is_named_after_its_caller() -> None:
    assert build_parser().prog == "libra" and build_parser("python -m libra").prog == "python -m libra"


def test_status_shows_lent_slots_and_the_lending_counters() -> None:
    from libra.commands.status import format_status

    actor = {"id": "h/lent-cpu0", "host": "h", "slot": "cpu0", "kinds": [], "state": "idle", "load": 0,
             "capacity": 4, "completed": 3, "capabilities": {"generate": ["default"]},
             "lent": {"owner": "fleet", "reclaimed_in_s": 2.5}}
    lending = {"reclaims": 1, "lent_again": 0, "moved_kv": 1, "handback_slack_s": [3.2],
               "reclaimed": {"h/lent-cpu0": {"owner": "fleet"}}}
    text = format_status([actor], {}, {"lending": lending})
    row = next(line for line in text.splitlines() if line.startswith("h/lent-cpu0"))
    assert "reclaimed" in row.split()
    assert "LENDING: reclaims=1, lent_again=0, moved_kv=1, reclaimed now=1, last hand-back +3.20s" in text
    lent = format_status([{**actor, "lent": {"owner": "fleet", "reclaimed_in_s": None}}], {}, {})
    assert "lent" in next(line for line in lent.splitlines() if line.startswith("h/lent-cpu0")).split()
