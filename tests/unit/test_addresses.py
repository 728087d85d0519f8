"""Addresses: one validator (``libra.transport.endpoints.parse_endpoint``) turns an address without ``tcp://``, with a
wrong scheme or without a port into a typed ``BadAddress`` (a ``LibraError``) that names the address, what is
accepted and the likely fix, before any socket is made; the CLI commands print it in one line and exit 2."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from libra.client import BadAddress, Client, LibraError
from libra.client.aio import AsyncClient
from libra.transport.endpoints import ACCEPTED, address_problem, parse_endpoint


@pytest.mark.parametrize("addr", ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:5555",
                                  "tcp://10.0.0.7:65535", "ipc:///tmp/libra.sock", "inproc://broker"])
def test_good_addresses_pass_unchanged(addr: str) -> None:
    assert address_problem(addr) is None and parse_endpoint(addr) == addr


@pytest.mark.parametrize("addr", ["tcp://*:5555", "tcp://0.0.0.0:*", "tcp://127.0.0.1:0"])
def test_a_bind_may_take_any_interface_and_any_port(addr: str) -> None:
    assert parse_endpoint(addr, "bind") == addr
    assert "bad broker address" in (address_problem(addr) or "")  # but no one can connect to a wildcard


@pytest.mark.parametrize("addr, why, fix", [
    ("127.0.0.1:5555", "no scheme", "tcp://127.0.0.1:5555"),
    ("localhost", "no scheme", "tcp://localhost:5555"),
    ("/run/libra/broker.sock", "no scheme", "ipc:///run/libra/broker.sock"),
    ("http://127.0.0.1:5555", "http:// is not a ZeroMQ transport", "tcp://127.0.0.1:5555"),
    ("https://broker.example:7000/api", "https:// is not a ZeroMQ transport", "tcp://broker.example:7000"),
    ("tcp://127.0.0.1", "no port", "tcp://127.0.0.1:5555"),
    ("tcp://127.0.0.1:http", "port 'http' is not a number", "tcp://127.0.0.1:5555"),
    ("tcp://127.0.0.1:70000", "port '70000' is not a number from 1 to 65535", "tcp://127.0.0.1:5555"),
    ("TCP://127.0.0.1:5555", "must be lower case", "tcp://127.0.0.1:5555"),
    (" tcp://127.0.0.1:5555", "spaces", "tcp://127.0.0.1:5555"),
])
def test_a_bad_address_names_itself_what_is_accepted_and_the_fix(addr: str, why: str, fix: str) -> None:
    with pytest.raises(BadAddress) as info:
        parse_endpoint(addr)
    msg = str(info.value)
    assert repr(addr) in msg and why in msg and f"did you mean {fix}?" in msg and ACCEPTED in msg
    assert info.value.address == addr and info.value.code == "bad_address"


@pytest.mark.parametrize("addr", ["", "ipc://", "inproc://", "tcp://:5555"])
def test_an_address_with_nothing_to_fix_from_still_says_what_is_accepted(addr: str) -> None:
    with pytest.raises(BadAddress, match="Libra takes tcp://HOST:PORT"):
        parse_endpoint(addr)


def test_bad_address_is_a_libra_error_and_a_value_error() -> None:
    assert issubclass(BadAddress, LibraError) and issubclass(BadAddress, ValueError)


def test_the_sync_client_raises_bad_address_not_zmq_error() -> None:
    for addr in ("127.0.0.1:5555", "http://127.0.0.1:5555"):
        with pytest.raises(LibraError, match="did you mean tcp://127.0.0.1:5555"):
            Client(addr, connect_timeout=None)


def test_the_async_client_raises_bad_address_not_zmq_error() -> None:
    async def make() -> None:
        AsyncClient("127.0.0.1:5555")

    with pytest.raises(BadAddress, match="did you mean tcp://127.0.0.1:5555"):
        asyncio.run(make())


def _libra(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "libra", *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv, prefix", [
    (["status", "--broker", "127.0.0.1:5555"], "libra status: "),
    (["status", "--watch", "--count", "1", "--broker", "127.0.0.1:5555"], "libra status: "),
    (["actors", "--broker", "127.0.0.1:5555", "--cpu-slots", "1", "--gpu-slots", "0", "--no-sandbox"],
     "libra.actors: "),
    (["run", "examples/arith_tiny.toml", "--broker", "http://127.0.0.1:5555"], "libra run: "),
    (["serve", "--broker", "127.0.0.1:5555", "--model-dir", "no-such-model"], "libra serve: "),
    (["dashboard", "--broker", "127.0.0.1:5555"], "libra dashboard: "),
])
def test_commands_given_a_bad_broker_address_print_one_line_and_exit_2(argv: list[str], prefix: str) -> None:
    r = _libra(*argv)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix + "bad broker address"), r.stderr
    assert "Traceback" not in r.stderr and "did you mean tcp://127.0.0.1:5555?" in lines[0]


def test_broker_bind_without_scheme_says_so_before_the_encryption_check() -> None:
    r = _libra("broker", "--bind", "127.0.0.1:5557")
    assert r.returncode == 2
    assert r.stderr.strip() == ("libra.broker: " + address_problem("127.0.0.1:5557", "bind")), r.stderr
    assert "without encryption" not in r.stderr and "did you mean tcp://127.0.0.1:5557?" in r.stderr
