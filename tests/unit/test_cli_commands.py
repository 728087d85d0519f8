"""One command line: ``libra`` (or ``python -m libra``) lists and runs every subcommand."""

from __future__ import annotations

import subprocess
import sys

from libra.cli import DELEGATES, build_parser
from libra.commands.status import format_status

ALL = ("broker", "actors", "status", "run", "sim", "bench", "plan", "keys", "demo", "tree", "serve", "dashboard")


def test_help_lists_every_subcommand() -> None:
    text = build_parser().format_help()
    for name in ALL:
        assert f"\n    {name} " in text, f"'libra --help' does not list {name!r}:\n{text}"


def test_delegated_subcommands_run_the_component_entry_point() -> None:
    assert set(DELEGATES) == {"broker", "actors", "sim", "bench", "serve", "dashboard"}
    out = subprocess.run([sys.executable, "-m", "libra", "bench", "--list"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert "broker" in out.stdout.split(), out.stdout  # the benchmark list, one name a line


def test_status_shows_the_tools_each_actor_offers() -> None:
    actors = [
        {"id": "h/cpu0", "host": "h", "slot": "cpu0", "kinds": ["action"], "state": "idle", "load": 0,
         "capacity": 4, "completed": 3, "capabilities": {"action": ["python", "echo", "bash"]}},
        {"id": "h/gpu0", "host": "h", "slot": "gpu0", "kinds": ["generate"], "state": "idle", "load": 0,
         "capacity": 8, "completed": 0, "capabilities": {"generate": ["*"]}},
    ]
    text = format_status(actors, {}, {})
    assert "TOOLS" in text.splitlines()[0]
    cpu = next(line for line in text.splitlines() if line.startswith("h/cpu0"))
    gpu = next(line for line in text.splitlines() if line.startswith("h/gpu0"))
    assert cpu.rstrip().endswith("bash,echo,python")
    assert gpu.rstrip().endswith("-")


def test_keys_creates_the_allow_directory_and_allow_copies_the_public_key(tmp_path) -> None:
    from libra.cli import main

    assert main(["keys", "--out", str(tmp_path / "keys"), "--name", "broker"]) == 0
    allowed = tmp_path / "keys" / "allowed"
    assert allowed.is_dir() and not any(allowed.iterdir())  # the broker's --curve-allow exists at once
    assert main(["keys", "--out", str(tmp_path / "keys"), "--name", "client", "--allow"]) == 0
    assert (allowed / "client.key").read_bytes() == (tmp_path / "keys" / "client.key").read_bytes()
    assert not (allowed / "client.key_secret").exists()
