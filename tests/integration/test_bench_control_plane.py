"""``bench control_plane`` at CI size (50 and 200 synthetic idle actors, 3.5 s each): the result's structure, no
actor wrongly declared lost, every synthetic actor in ``libra status``; and a silent listener on the broker's
port (what a saturated broker looks like) reported as possibly overloaded, the CURVE hint second."""

from __future__ import annotations

import argparse
import socket

import pytest

from libra.bench import control_plane
from libra.client import BrokerUnreachable, Client

pytestmark = pytest.mark.integration


def test_bench_control_plane_small() -> None:
    # held 3.5 s: the broker beats an idle actor every 3 s (its default), and the farms must see it do so
    args = argparse.Namespace(actors="50,200", seconds=3.5, farms=2, calls=30, heartbeat_s=1.0, idle_heartbeat_s="",
                              out=None)
    res = control_plane.run(args)
    assert [p["actors"] for p in res["points"]] == [control_plane.BASELINE, 50, 200]
    for p in res["points"]:
        assert p["seen_in_status"] == p["actors"], p
        assert p["wrongly_lost"] == 0 and p["broker_actors_expired"] == 0, p
        assert p["unexpected_frames"] == 0 and p["broker_ticks_behind"] == 0, p
        assert p["idle_heartbeat_s"] == 3.0, p  # the broker's default
        # one setting: each point is its own reference (none when psutil saw no CPU time, as at 10 idle actors)
        assert p["cpu_vs_first_setting"] == (1.0 if p["broker_cpu_per_s"] > 0 else None), p
        assert p["heartbeats_sent"] > 0 and p["broker_heartbeats_received"] > 0, p
        assert p["broker_rss_mb"] > 0 and p["broker_cpu_per_s"] >= 0, p
        for via in ("echo_broker", "echo_direct"):
            e = p[via]
            assert e["p50_ms"] > 0 and e["p99_ms"] >= e["p50_ms"] and e["p50_ratio"] > 0, (via, p)
    assert res["points"][0]["echo_broker"]["p50_ratio"] == 1.0
    text = control_plane.fmt({**res, "wall_s": 0})
    assert "200" in text and "x10" in text


def test_silent_broker_port_is_reported_as_maybe_overloaded() -> None:
    with socket.socket() as srv:  # accepts TCP connections, never answers: a saturated broker from outside
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        url = f"tcp://127.0.0.1:{srv.getsockname()[1]}"
        with pytest.raises(BrokerUnreachable) as ei:
            with Client(url, connect_timeout=1.0) as c:
                c.status(timeout=1.0)
    msg = str(ei.value)
    assert "overloaded" in msg and "not a libra broker" in msg, msg
    assert msg.index("overloaded") < msg.index("CURVE"), msg


def test_closed_port_is_not_called_overloaded() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BrokerUnreachable) as ei:
        with Client(f"tcp://127.0.0.1:{port}", connect_timeout=1.0) as c:
            c.status(timeout=1.0)
    msg = str(ei.value)
    assert "overloaded" not in msg and "is it running there?" in msg and "CURVE" in msg, msg


def test_a_broker_started_with_256_open_files_holds_400_actors() -> None:
    """A soft limit of 256 open files (the test process's, inherited by the broker it starts) would stop the
    broker's accepts near 250 peers: the actors' hellos are never seen and the bench waits for ever. The broker
    raises its soft limit to the hard one at start (libra.transport.fdlimit)."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard open-files limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        args = argparse.Namespace(actors="400", seconds=1.0, farms=2, calls=10, heartbeat_s=1.0, idle_heartbeat_s="",
                                  out=None)
        res = control_plane.run(args)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    point = res["points"][-1]
    assert point["actors"] == 400 and point["seen_in_status"] == 400, point
    assert point["wrongly_lost"] == 0, point
