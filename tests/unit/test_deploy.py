"""deploy/: the systemd units pass ``systemd-analyze verify``, say what the design promises, and their
command lines are accepted by the real argument parsers; the example configs load."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from libra.actors.runtime import build_parser as actor_parser
from libra.broker.__main__ import build_parser as broker_parser
from libra.broker.state import BrokerConfig
from libra.config import load_section

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = DEPLOY / "systemd"
INSTALLED_PYTHON = "/opt/libra/venv/bin/python"


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """systemd unit syntax: sections of repeated ``Key=value`` lines (configparser cannot repeat keys)."""
    out: dict[str, list[tuple[str, str]]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, [])
            continue
        key, _, value = line.partition("=")
        out[section].append((key.strip(), value.strip()))
    return out


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    (v,) = values(unit, section, key)
    return v


@pytest.fixture(scope="module")
def units() -> dict[str, dict[str, list[tuple[str, str]]]]:
    return {p.name: parse_unit(p) for p in UNITS.rglob("*") if p.is_file()}


def test_units_and_dropins_exist(units) -> None:
    assert set(units) == {"libra.target", "libra-broker.service", "libra-actor@.service", "override-hardened.conf"}
    assert (UNITS / "libra-broker.service.d" / "override-hardened.conf").is_file()
    assert (UNITS / "libra-actor@.service.d" / "override-hardened.conf").is_file()


@pytest.mark.parametrize("name", ["libra-broker.service", "libra-actor@.service"])
def test_services_are_notify_restart_always_and_part_of_the_target(units, name: str) -> None:
    u = units[name]
    assert one(u, "Service", "Type") == "notify"
    assert one(u, "Service", "NotifyAccess") == "main"
    assert one(u, "Service", "Restart") == "always"
    assert one(u, "Service", "RestartSec") == "3"
    assert one(u, "Unit", "PartOf") == "libra.target"
    assert one(u, "Install", "WantedBy") == "libra.target"


def test_actor_template_runs_one_slot_with_asserted_per_slot_config(units) -> None:
    u = units["libra-actor@.service"]
    assert one(u, "Unit", "AssertPathExists") == "/etc/libra/actors/%i.conf"
    assert "/etc/libra/actors/%i.conf" in values(u, "Service", "EnvironmentFile")
    assert "libra-broker.service" in one(u, "Unit", "After").split()
    assert one(u, "Service", "SyslogIdentifier") == "libra-actor-%i"
    argv = shlex.split(one(u, "Service", "ExecStart"))
    assert argv[:3] == [INSTALLED_PYTHON, "-m", "libra.actors.runtime"]
    assert argv[argv.index("--slot") + 1] == "%i"


def _expand(argv: list[str], env: dict[str, str], instance: str) -> list[str]:
    """What systemd passes: ``${X}`` is one word, ``$X`` splits on whitespace, ``%i`` is the instance."""
    out: list[str] = []
    for a in argv:
        if a.startswith("$") and not a.startswith("${"):
            out += env.get(a[1:], "").split()
            continue
        for k, v in env.items():
            a = a.replace("${" + k + "}", v)
        out.append(a.replace("%i", instance))
    return out


def _environment(u: dict[str, list[tuple[str, str]]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in values(u, "Service", "Environment"):
        for item in shlex.split(line):
            k, _, v = item.partition("=")
            env[k] = v
    return env


def _env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            env[k.strip()] = v.strip()
    return env


@pytest.mark.parametrize("slot, conf", [("cpu0", "cpu0.conf.example"), ("gpu0", "gpu0.conf.example")])
def test_actor_command_line_is_accepted_by_the_runtime_parser(units, slot: str, conf: str) -> None:
    u = units["libra-actor@.service"]
    env = {**_environment(u), **_env_file(DEPLOY / "default" / "libra.example"),
           **_env_file(DEPLOY / "config" / "actors" / conf)}
    argv = _expand(shlex.split(one(u, "Service", "ExecStart")), env, slot)[3:]
    args = actor_parser().parse_args(argv)
    assert args.slot == slot and args.broker == env["LIBRA_BROKER"] and args.capacity == int(env["LIBRA_CAPACITY"])


def test_broker_command_line_is_accepted_by_the_broker_parser(units) -> None:
    u = units["libra-broker.service"]
    env = {**_environment(u), **_env_file(DEPLOY / "default" / "libra.example")}
    argv = _expand(shlex.split(one(u, "Service", "ExecStart")), env, "")
    assert argv[:3] == [INSTALLED_PYTHON, "-m", "libra.broker"]
    args = broker_parser().parse_args(argv[3:])
    assert args.bind == "tcp://0.0.0.0:5555" and args.metrics_port == 9464
    assert args.config == "/etc/libra/broker.toml" == one(u, "Unit", "AssertPathExists")


def test_hardening_keeps_gpu_device_nodes_visible_to_actors() -> None:
    actor = parse_unit(UNITS / "libra-actor@.service.d" / "override-hardened.conf")
    broker = parse_unit(UNITS / "libra-broker.service.d" / "override-hardened.conf")
    assert values(actor, "Service", "PrivateDevices") == []  # it would hide /dev/nvidia*
    assert one(actor, "Service", "DevicePolicy") == "closed"
    allowed = {v.split()[0] for v in values(actor, "Service", "DeviceAllow")}
    assert {"char-nvidia-frontend", "char-nvidia-uvm", "/dev/nvidiactl", "/dev/nvidia-uvm"} <= allowed
    assert values(actor, "Service", "RestrictNamespaces") == []  # bubblewrap needs namespaces
    assert one(broker, "Service", "PrivateDevices") == "true"
    assert one(broker, "Service", "ProtectSystem") == "strict"


def test_example_broker_config_loads_into_broker_config() -> None:
    cfg = load_section(DEPLOY / "libra.toml.example", "broker", BrokerConfig)
    assert cfg.heartbeat_s == 1.0 and cfg.liveness == 3 and cfg.router == "cmlfq"


def _verify(tmp_path: Path, *names: str) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` on a copy of deploy/systemd whose ExecStart uses this interpreter."""
    d = tmp_path / "units"
    shutil.copytree(UNITS, d)
    for p in d.glob("*.service"):
        p.write_text(p.read_text().replace(INSTALLED_PYTHON, sys.executable))
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *names], cwd=d, capture_output=True,
                          text=True, timeout=60, check=False)


needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not installed (apt-get install systemd)")


@needs_analyze
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    r = _verify(tmp_path, "./libra.target", "./libra-broker.service", "./libra-actor@cpu0.service",
                "./libra-actor@gpu0.service")
    assert r.returncode == 0, r.stderr
    assert "libra" not in r.stderr, r.stderr  # no warning about our units or drop-ins


@needs_analyze
def test_verify_does_catch_a_broken_unit(tmp_path: Path) -> None:
    d = tmp_path / "units"
    r = _verify(tmp_path, "./libra-broker.service")
    assert r.returncode == 0, r.stderr
    svc = d / "libra-broker.service"
    svc.write_text(svc.read_text().replace(sys.executable, "/nonexistent/python"))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", "./libra-broker.service"], cwd=d,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "/nonexistent/python" in r.stderr
