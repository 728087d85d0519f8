"""The broker's core pools (bitsets kept up to date on grant and release) make exactly the decisions of the
scanning implementation they replaced (:class:`~libra.bench.placement_ref.ScanningCorePools`): the same actor
and the same core ids for every grant, the same free counts and the same answers to take and give back, on
random sequences of grants, adoptions, releases, reconnects and departures over hosts whose actors share
(some of) their CPU ids, NUMA nodes of different sizes, and actors that report no ids."""

from __future__ import annotations

import random

import pytest

from libra.bench.placement_ref import ScanningCorePools
from libra.broker.core_pools import CorePools
from libra.broker.sessions import ActorSession


def _session(peer: str, host: str, labels: dict, cores: int) -> ActorSession:
    return ActorSession(peer.encode(), peer, host, "cpu0", 1, {"action": frozenset({"python"})},
                        frozenset({"action"}), cores, labels, 0.0, 0.0, 0.0, cores=cores)


_NODE: dict[str, list[int]] = {}


def _random_actor(rng: random.Random, i: int) -> ActorSession:
    host = f"h{rng.randrange(3)}"
    kind = rng.random()
    if kind < 0.25:  # no ids: a private pool of anonymous cores
        return _session(f"a{i}", host, {"cores": rng.randrange(1, 20)}, rng.randrange(1, 20))
    base = rng.randrange(0, 4) * 8
    cpus = sorted(rng.sample(range(base, base + 40), rng.randrange(1, 32)))
    numa = [_NODE[host][c] for c in cpus]  # one CPU id of one host sits on one NUMA node, whoever reports it
    labels: dict = {"cores": len(cpus), "cpus": cpus, "numa": numa}
    if rng.random() < 0.1:
        labels = {"cores": len(cpus), "cpus": cpus}  # ids without NUMA nodes: all on node 0
    return _session(f"a{i}", host, labels, len(cpus))


@pytest.mark.parametrize("seed", range(40))
def test_random_grant_release_sequences_decide_like_the_scanning_pools(seed: int) -> None:
    rng = random.Random(seed)
    for h in ("h0", "h1", "h2"):  # contiguous nodes of random sizes, or ids scattered over the nodes
        nodes = rng.randrange(1, 5)
        _NODE[h] = [c * nodes // 72 if rng.random() < 0.6 else rng.randrange(nodes) for c in range(72)]
    new, ref = CorePools(), ScanningCorePools()
    actors = [_random_actor(rng, i) for i in range(rng.randrange(1, 7))]
    held: list[str] = []
    for step in range(300):
        op = rng.random()
        if op < 0.55:  # a grant placed best fit, as one placement round does
            cands = [a for a in actors if rng.random() < 0.8]
            n, least = rng.randrange(1, 12), rng.randrange(1, 4)
            home = rng.choice(actors).actor_id if actors and rng.random() < 0.3 else None
            got, want = new.best_fit(cands, n, least, home), ref.best_fit(cands, n, least, home)
            assert (got and (got[0].peer, got[1])) == (want and (want[0].peer, want[1])), step
            if got is not None:
                wid = f"w{step}"
                assert new.take(wid, got[0], got[1]) is ref.take(wid, got[0], got[1]) is True
                held.append(wid)
        elif op < 0.65 and actors:  # an adopted action reports ids of its own: taken only if all are free
            s = rng.choice(actors)
            ids = rng.sample(range(80), rng.randrange(0, 4))
            wid = f"adopt{step}"
            assert new.take(wid, s, ids) is ref.take(wid, s, ids)
            held.append(wid)
        elif op < 0.9 and held:
            wid = held.pop(rng.randrange(len(held)))
            assert new.give_back(wid) == ref.give_back(wid)
        elif op < 0.95:  # an actor leaves, another connects (or one reconnects as a new session)
            if actors and rng.random() < 0.5:
                actors.pop(rng.randrange(len(actors)))
            else:
                actors.append(_random_actor(rng, 100 + step) if rng.random() < 0.7 or not actors
                              else _session(actors[0].actor_id, actors[0].host, dict(actors[0].labels),
                                            actors[0].cores))
            new.forget(a.peer for a in actors)
            ref.forget(a.peer for a in actors)
        assert new.total_free(actors) == ref.total_free(actors)
        for a in actors:
            assert new.free_ids(a) == ref.free_ids(a)
            assert new.free_count(a) == len(ref.free_ids(a))
        assert [new.holds(w) for w in held] == [ref.holds(w) for w in held]


def test_a_grant_releases_and_frees_its_cores_in_every_numa_node() -> None:
    pools = CorePools()
    a = _session("a", "h", {"cpus": list(range(8)), "numa": [0, 0, 0, 0, 1, 1, 1, 1]}, 8)
    s, ids = pools.best_fit([a], 6)
    assert ids == (0, 1, 2, 3, 4, 5)  # no node has 6: the most-free nodes, lowest ids first
    assert pools.take("w", s, ids)
    assert pools.best_fit([a], 2) == (a, (6, 7))
    assert not pools.take("x", a, [5])  # held by w
    assert not pools.take("y", a, ["3"])  # not a CPU id: refused, nothing taken
    assert pools.give_back("w") == 6 and pools.free_count(a) == 8 and pools.give_back("w") == 0


def test_labels_that_do_not_parse_are_reported_once_with_the_reason() -> None:
    pools = CorePools()
    bad = _session("bad", "h", {"cpus": [0, 0, 1]}, 4)  # repeated ids: the labels do not parse
    good = _session("good", "h", {"cpus": [2, 3]}, 2)
    pools.best_fit([bad, good], 1)
    reported = pools.take_unparsed()
    assert [aid for aid, _ in reported] == ["bad"] and "cpus" in reported[0][1]
    assert pools.free_count(bad) == 4  # its own cores (the fallback), and it is not reported again
    assert pools.take_unparsed() == []
