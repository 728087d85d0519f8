"""The broker's core pools against a brute-force oracle on small hosts.

:meth:`CorePools.best_fit` is checked against an exhaustive search: every candidate actor and every set of
``n`` of its free CPU ids, ranked by the order the module documents (the trajectory's home actor first, then
a placement inside one NUMA node before one that spans nodes, then the fewest free cores left, then actor
id; inside the actor the fitting node with the fewest free cores and its lowest ids, or, when no node fits,
the most-free nodes first and their lowest ids; when no actor fits, the widest actor's free cores if at
least ``least``). The bookkeeping (take, give back, free ids, distinct free cores of a host) is checked
against plain sets. Random sequences of grants, adoptions, releases, departures and reconnects run over
hosts whose actors share some of their CPU ids, NUMA nodes of different sizes, and actors with no ids.
"""

from __future__ import annotations

import itertools
import random

import pytest

from libra.broker.core_pools import CorePools
from libra.broker.sessions import ActorSession

IDS = 10  # CPU ids per host: every n-subset of an actor's free ids is enumerated


def _session(peer: str, host: str, labels: dict, cores: int) -> ActorSession:
    return ActorSession(peer.encode(), peer, host, "cpu0", 1, {"action": frozenset({"python"})},
                        frozenset({"action"}), cores, labels, 0.0, 0.0, 0.0, cores=cores)


class Oracle:
    """Plain sets: the ids each actor may use, the NUMA node of each id, and which work holds which id."""

    def __init__(self, node_of: dict[str, list[int]]) -> None:
        self.node_of = node_of
        self.used: dict[str, dict[int, str]] = {}  # pool -> cpu id -> work id
        self.held: dict[str, tuple[str, tuple[int, ...]]] = {}

    @staticmethod
    def pool(s: ActorSession) -> str:
        return f"host:{s.host}" if "cpus" in s.labels else f"actor:{s.peer.hex()}"

    def ids(self, s: ActorSession) -> set[int]:
        return set(s.labels["cpus"]) if "cpus" in s.labels else set(range(s.cores))

    def node(self, s: ActorSession, c: int) -> int:
        return self.node_of[s.host][c] if "numa" in s.labels else 0

    def free(self, s: ActorSession) -> set[int]:
        return self.ids(s) - set(self.used.get(self.pool(s), {}))

    def best_fit(self, cands: list[ActorSession], n: int, least: int, home: str | None):
        best = None
        for s in cands:
            free = self.free(s)
            per_node: dict[int, set[int]] = {}
            for c in free:
                per_node.setdefault(self.node(s, c), set()).add(c)
            if len(free) >= n:
                spans = all(len(v) < n for v in per_node.values())
                head = (s.actor_id != home, spans, len(free) - n, s.actor_id)
            elif len(free) >= least and not any(len(self.free(o)) >= n for o in cands):
                head = (-len(free), s.actor_id != home, s.actor_id)
            else:
                continue
            k = min(n, len(free))
            rank = {nd: r for r, nd in enumerate(sorted(per_node, key=lambda nd: (-len(per_node[nd]), nd)))}
            for subset in itertools.combinations(sorted(free), k):
                nodes = {self.node(s, c) for c in subset}
                if len(free) >= n and not head[1]:  # fits one node: one node, the fullest that fits
                    if len(nodes) > 1:
                        continue
                    (nd,) = nodes
                    tail = (len(per_node[nd]), nd, subset)
                else:
                    tail = tuple(sorted((rank[self.node(s, c)], c) for c in subset))
                key = (head, tail)
                if best is None or key < best[0]:
                    best = (key, s, subset)
        return None if best is None else (best[1].peer, tuple(sorted(best[2])))

    def take(self, wid: str, s: ActorSession, ids: list) -> bool:
        if wid in self.held or not all(isinstance(c, int) and c >= 0 for c in ids):
            return False
        if not set(ids) <= self.free(s):
            return False
        used = self.used.setdefault(self.pool(s), {})
        for c in ids:
            used[c] = wid
        self.held[wid] = (self.pool(s), tuple(ids))
        return True

    def give_back(self, wid: str) -> int:
        if wid not in self.held:
            return 0
        pool, ids = self.held.pop(wid)
        for c in ids:
            del self.used[pool][c]
        return len(ids)

    def total_free(self, actors: list[ActorSession]) -> int:
        reach: dict[str, set[int]] = {}
        for s in actors:
            reach.setdefault(self.pool(s), set()).update(self.free(s))
        return sum(len(v) for v in reach.values())


def _random_actor(rng: random.Random, i: int, node_of: dict[str, list[int]]) -> ActorSession:
    kind = rng.random()
    if kind < 0.2:  # no ids: a private pool of anonymous cores
        cores = rng.randrange(1, 7)
        return _session(f"a{i}", f"h{rng.randrange(3)}", {"cores": cores}, cores)
    if kind < 0.3:  # ids without NUMA nodes (all on node 0), on a host of their own
        cpus = sorted(rng.sample(range(IDS), rng.randrange(1, IDS)))
        return _session(f"a{i}", "flat", {"cores": len(cpus), "cpus": cpus}, len(cpus))
    host = f"h{rng.randrange(2)}"
    cpus = sorted(rng.sample(range(IDS), rng.randrange(1, IDS + 1)))
    numa = [node_of[host][c] for c in cpus]  # one CPU id of one host sits on one NUMA node, whoever reports it
    return _session(f"a{i}", host, {"cores": len(cpus), "cpus": cpus, "numa": numa}, len(cpus))


@pytest.mark.parametrize("seed", range(30))
def test_random_grant_release_sequences_match_the_brute_force_oracle(seed: int) -> None:
    rng = random.Random(seed)
    node_of: dict[str, list[int]] = {}
    for h in ("h0", "h1"):  # contiguous nodes of random sizes, or ids scattered over the nodes
        nodes = rng.randrange(1, 4)
        node_of[h] = [c * nodes // IDS if rng.random() < 0.6 else rng.randrange(nodes) for c in range(IDS)]
    pools, oracle = CorePools(), Oracle(node_of)
    actors = [_random_actor(rng, i, node_of) for i in range(rng.randrange(1, 5))]
    held: list[str] = []
    grants = 0
    for step in range(150):
        op = rng.random()
        if op < 0.55:  # a grant placed best fit, as one placement round does
            cands = [a for a in actors if rng.random() < 0.8]
            n, least = rng.randrange(1, 6), rng.randrange(1, 4)
            home = rng.choice(actors).actor_id if actors and rng.random() < 0.3 else None
            got, want = pools.best_fit(cands, n, least, home), oracle.best_fit(cands, n, least, home)
            assert (got and (got[0].peer, tuple(got[1]))) == want, step
            if got is not None:
                wid = f"w{step}"
                assert pools.take(wid, got[0], got[1]) is oracle.take(wid, got[0], list(got[1])) is True
                held.append(wid)
                grants += 1
        elif op < 0.65 and actors:  # an adopted action reports ids of its own: taken only if all are free
            s = rng.choice(actors)
            ids = rng.sample(range(IDS + 2), rng.randrange(0, 4))
            wid = f"adopt{step}"
            assert pools.take(wid, s, ids) is oracle.take(wid, s, ids)
            held.append(wid)
        elif op < 0.9 and held:
            wid = held.pop(rng.randrange(len(held)))
            assert pools.give_back(wid) == oracle.give_back(wid)
        elif op < 0.95:  # an actor leaves, another connects (or one reconnects as a new session)
            if actors and rng.random() < 0.5:
                actors.pop(rng.randrange(len(actors)))
            elif actors and rng.random() < 0.3:
                a = actors[0]
                actors[0] = _session(a.actor_id, a.host, dict(a.labels), a.cores)
            else:
                actors.append(_random_actor(rng, 100 + step, node_of))
            pools.forget(a.peer for a in actors)
        assert pools.total_free(actors) == oracle.total_free(actors)
        for a in actors:
            assert pools.free_ids(a) == sorted(oracle.free(a))
            assert pools.free_count(a) == len(oracle.free(a))
        assert [pools.holds(w) for w in held] == [w in oracle.held for w in held]
    assert grants > 0


def test_the_oracle_ranks_by_the_documented_order() -> None:
    """Hand-worked: the oracle itself prefers one node over spanning, then the fewest left, then home."""
    node_of = {"h": [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]}
    oracle = Oracle(node_of)
    a = _session("a", "h", {"cpus": [0, 1, 2, 3, 4, 5], "numa": [0, 0, 0, 0, 1, 1]}, 6)  # 4 + 2 per node
    b = _session("b", "h2", {"cores": 3}, 3)  # private pool of 3
    assert oracle.best_fit([a, b], 3, 1, None) == (b.peer, (0, 1, 2))  # both fit in a node: b leaves 0 free
    assert oracle.best_fit([a, b], 3, 1, "a") == (a.peer, (0, 1, 2))  # home first; node 0 (4 free) fits 3
    assert oracle.best_fit([a, b], 2, 1, None) == (b.peer, (0, 1))  # b leaves 1 free, a 4
    assert oracle.best_fit([a], 2, 1, None) == (a.peer, (4, 5))  # node 1 (2 free) is the fullest that fits
    assert oracle.best_fit([a], 5, 1, None) == (a.peer, (0, 1, 2, 3, 4))  # spans: most-free node first
    assert oracle.best_fit([a, b], 9, 1, None) == (a.peer, (0, 1, 2, 3, 4, 5))  # shrinks to the widest
    assert oracle.best_fit([b], 9, 4, None) is None  # the widest has fewer than least


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
