"""Fixtures that start real brokers and actors (``python -m libra.broker`` / ``libra.actors``) on loopback."""

from __future__ import annotations

import pytest

from libra.local import LocalCluster


@pytest.fixture
def cluster():
    """A broker with a fast heartbeat (0.3 s × 3) and two CPU actor slots (no restarts)."""
    c = LocalCluster(cpu_slots=2, broker_args=["--heartbeat-s", "0.3", "--liveness", "3"],
                     actor_args=["--no-restart", "--no-sandbox", "--capacity", "4"])
    c.start(timeout=60)
    yield c
    c.stop()
