"""A standby broker takes over from a killed primary (#32): nothing lost, nothing run twice.

1. Loopback: a primary (``--replicate-bind``) and a standby (``--standby-of``), CPU actors with ``--broker P,S``
   and a client with both; 1,000 side-effecting ``bash`` calls (each appends its id to a ledger outside the
   sandbox, then sleeps); the primary is SIGKILLed once some have run and nothing is restarted. Every call is
   answered once, ran once (the ledger), and says truly how often it started (``libra.bench.failover``).
2. Three network namespaces (primary host, standby host, workers + client host) joined by a bridge, CURVE on
   (the two brokers share a key pair, as the actors hold one broker key; the replication stream is CURVE
   too): every process in the primary's namespace is SIGKILLed and its link taken down while 1,000 calls
   wait. Needs root and iproute2; skipped otherwise (CI runs as root).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from libra.bench.chaos import _ledger, unisolated_path
from libra.bench.failover import failover
from libra.transport.keys import create_keypair

from .procs import stop_all

pytestmark = pytest.mark.integration
IP = shutil.which("ip") or "ip"  # by path: the actors' PATH is cut down to the shell tools


def test_primary_sigkill_with_1000_calls_pending_standby_takes_over(tmp_path) -> None:
    r = failover(tmp_path, True, calls=1000, kill_after=100)
    print(f"\n{json.dumps(r)}")
    assert r["answered"] == 1000 and r["lost"] == 0
    assert r["executed_twice"] == 0 and r["never_ran"] == 0 and r["attempts_untrue"] == 0
    assert r["restored"] > 0  # the standby served from the replicated journal, not from scratch
    assert r["reattached"] > 0  # the client's resent request ids were recognised there


CLIENT = r"""
import json, sys, time
from libra.client import Client
urls, n, ledger = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
with Client(urls, connect_timeout=60) as c:
    deadline = time.monotonic() + 120
    while len(c.status().actors) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    futs = [c.submit_tool("bash", {"command": f"echo {i} $EPOCHREALTIME >> {ledger}; sleep 0.05"}, timeout=900)
            for i in range(n)]
    print("SUBMITTED", flush=True)
    out = [[repr(r), 0] if isinstance(r, Exception) else
           [r.output.get("exit_code") if isinstance(r.output, dict) else None, r.attempts] for r in c.gather(futs)]
    print(json.dumps({"results": out, "url": c.broker_url, "stats": c.status().stats}), flush=True)
"""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def three_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = uuid.uuid4().hex[:6]
    p, s, w = f"lf-p-{tag}", f"lf-s-{tag}", f"lf-w-{tag}"
    try:
        _sh("ip", "netns", "add", p)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode(errors='replace').strip()}")
    made = [p]
    try:
        for ns in (s, w):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        br = f"br{tag}"
        _sh("ip", "-n", w, "link", "add", br, "type", "bridge")
        _sh("ip", "-n", w, "addr", "add", "10.232.9.3/24", "dev", br)
        _sh("ip", "-n", w, "link", "set", br, "up")
        _sh("ip", "-n", w, "link", "set", "lo", "up")
        for ns, dev, addr in ((p, f"vp{tag}", "10.232.9.1/24"), (s, f"vs{tag}", "10.232.9.2/24")):
            peer = f"{dev}w"
            _sh("ip", "link", "add", dev, "type", "veth", "peer", "name", peer)
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "link", "set", peer, "netns", w)
            _sh("ip", "-n", w, "link", "set", peer, "master", br)
            _sh("ip", "-n", w, "link", "set", peer, "up")
            _sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield p, s, w, f"vp{tag}"
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _kill_namespace(ns: str, dev: str) -> None:
    """SIGKILL every process in ``ns`` (the primary host dies) and take its link down."""
    pids = subprocess.run([IP, "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass
    _sh("ip", "-n", ns, "link", "set", dev, "down")


def _wait_file(path, needle: bytes, proc: subprocess.Popen, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_bytes():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}: {path.read_text(errors='replace')}")
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} never appeared in {path}")


def _tails(d) -> str:
    """The last lines of the processes' logs (a failure's evidence)."""
    return "\n".join(f"--- {name}\n" + "\n".join((d / name).read_text(errors="replace").splitlines()[-15:])
                     for name in ("primary.log", "standby.log", "workers.log") if (d / name).exists())


def test_primary_namespace_killed_with_1000_calls_pending(three_hosts, tmp_path) -> None:
    p, s, w, pdev = three_hosts
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    broker_kp = create_keypair(keys, "broker")
    for name in ("workers", "client", "broker"):
        kp = broker_kp if name == "broker" else create_keypair(keys, name)
        shutil.copy(kp.public_file, allowed / kp.public_file.name)  # the standby connects with the broker pair
    py, n = sys.executable, 1000
    ledger = tmp_path / "ledger"
    ledger.write_text("")
    curve = ["--curve-secret", str(broker_kp.secret_file), "--curve-allow", str(allowed)]
    # --no-ipc: the namespaces share /tmp, where both brokers (port 5555 each) would put the same Unix path
    common = ["--bind", "tcp://0.0.0.0:5555", "--heartbeat-s", "0.3", "--log-level", "info", "--no-ipc", *curve]
    plog, slog = tmp_path / "primary.log", tmp_path / "standby.log"
    with plog.open("wb") as pout, slog.open("wb") as sout:
        procs = [subprocess.Popen([IP, "netns", "exec", p, py, "-m", "libra.broker", *common, "--journal",
                                   str(tmp_path / "p.sqlite"), "--replicate-bind", "tcp://0.0.0.0:5556"],
                                  stdout=pout, stderr=subprocess.STDOUT),
                 subprocess.Popen([IP, "netns", "exec", s, py, "-m", "libra.broker", *common, "--journal",
                                   str(tmp_path / "s.sqlite"), "--standby-of", "tcp://10.232.9.1:5556"],
                                  stdout=sout, stderr=subprocess.STDOUT)]
    urls = "tcp://10.232.9.1:5555,tcp://10.232.9.2:5555"

    def env(name: str, **extra: str) -> dict[str, str]:
        return {**os.environ, "LIBRA_CURVE_SECRET": str(keys / f"{name}.key_secret"),
                "LIBRA_BROKER_KEY": str(broker_kp.public_file), **extra}

    try:
        _wait_file(plog, b"replica_in_sync", procs[0])
        with (tmp_path / "workers.log").open("wb") as wout:
            procs.append(subprocess.Popen([IP, "netns", "exec", w, py, "-m", "libra.actors", "--broker", urls,
                                           "--cpu-slots", "2", "--gpu-slots", "0", "--allow-unisolated",
                                           "--capacity", "8", "--log-level", "warning"],
                                          env=env("workers", PATH=unisolated_path(tmp_path)), stdout=wout,
                                          stderr=subprocess.STDOUT))
        client = subprocess.Popen([IP, "netns", "exec", w, py, "-c", CLIENT, urls, str(n), str(ledger)],
                                  env=env("client"), stdout=subprocess.PIPE, text=True)
        procs.append(client)
        assert client.stdout is not None and client.stdout.readline().strip() == "SUBMITTED"
        deadline = time.monotonic() + 120
        while len(_ledger(ledger)) < 100:
            time.sleep(0.01)
            assert time.monotonic() < deadline, _tails(tmp_path)
        _kill_namespace(p, pdev)
        killed = time.time()
        out, _ = client.communicate(timeout=600)
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        stop_all(procs)
    runs = _ledger(ledger)
    counts = collections.Counter(i for i, _ in runs)
    results = result["results"]
    print(f"\nran_before_kill={sum(1 for _, t in runs if t < killed)} ended_on={result['url']} "
          f"stats={ {k: result['stats'].get(k) for k in ('restored', 'adopted', 'duplicates', 'revoked_at_hello')} }")
    assert result["url"] == "tcp://10.232.9.2:5555"  # the client ended on the standby
    assert b"standby_takeover" in slog.read_bytes()
    assert [code for code, _ in results] == [0] * n  # every call answered, successfully
    assert sorted(counts) == sorted(str(i) for i in range(n)) and max(counts.values()) == 1  # each ran once
    assert all(att == counts[str(i)] for i, (_, att) in enumerate(results))  # attempts truthful
