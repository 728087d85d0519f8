"""Pair groups of the torch.distributed weights transport (libra/weights/pairs.py, torch_dist.py), on CPU with
gloo: one group per publisher/fetcher pair reused across versions, destroyed at close, dropped when its fetcher
is lost."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch
import torch.distributed as dist

from libra.weights.torch_dist import TorchWeightFetcher, TorchWeightPublisher


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 16, generator=g), "b": torch.randn(16, generator=g).to(torch.bfloat16)}


def _until(pred, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_many_versions_between_one_pair_form_one_group_each_side_and_close_destroys_them(monkeypatch) -> None:
    made: list[int] = []
    real = dist.ProcessGroupGloo

    def counting(*args, **kwargs):  # every gloo group either end forms, old code or new
        made.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "ProcessGroupGloo", counting)
    pub = TorchWeightPublisher(keep=2, backend="gloo", timeout_s=30)
    f = TorchWeightFetcher(timeout_s=30)
    try:
        for v in range(1, 6):
            sd, version, _ = f.fetch(pub.publish(v, _state(v)))
            assert version == v and torch.equal(sd["w"], _state(v)["w"]) and torch.equal(sd["b"], _state(v)["b"])
        assert sorted(made) == [0, 1]  # one group per side for five versions (was one per side per fetch)
        assert (pub.pairs.made, len(pub.pairs), f.pairs.made, len(f.pairs)) == (1, 1, 1, 1)
        f.close()  # the fetcher leaves: its side is destroyed and the publisher drops its own
        assert (len(f.pairs), f.pairs.destroyed) == (0, 1)
        _until(lambda: len(pub.pairs) == 0, "the publisher kept the group of a fetcher that closed")
        f2 = TorchWeightFetcher(timeout_s=30)
        assert f2.fetch(pub.publish(6, _state(6)))[1] == 6 and len(pub.pairs) == 1
    finally:
        pub.close()
    assert len(pub.pairs) == 0 and pub.pairs.destroyed == pub.pairs.made == 2  # close() destroyed the last one


def _fetch_then_die(ref: dict, out: mp.Queue) -> None:  # a rollout actor that is killed after one fetch
    import os

    f = TorchWeightFetcher(timeout_s=30)
    _, version, _ = f.fetch(ref)
    out.put((version, f.peer, f.pairs.generation((ref["endpoint"], "gloo"))))
    out.close()
    out.join_thread()
    os._exit(0)  # no close(): the publisher is not told


def test_a_lost_fetchers_group_is_dropped_and_a_new_fetcher_still_works() -> None:
    pub = TorchWeightPublisher(keep=2, backend="gloo", timeout_s=20)
    try:
        ref = pub.publish(1, {"w": torch.randn(4 * 1024 * 1024)})  # 16 MiB: more than a socket buffer
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        kid = ctx.Process(target=_fetch_then_die, args=(ref, q))
        kid.start()
        version, peer, gen = q.get(timeout=120)
        kid.join(timeout=60)
        assert version == 1 and gen is not None and len(pub.pairs) == 1
        # the dead fetcher's next request (sent for it here): the publisher reuses the pair, its broadcast
        # fails on the dead peer, and that pair's group is dropped
        ghost = TorchWeightFetcher(timeout_s=20)
        ghost.peer = peer
        answer = ghost.request(ghost._store(ref["endpoint"]), 1, "gloo", gen)
        assert answer == {"answer": "ok", "gen": gen, "ticket": answer["ticket"]}
        _until(lambda: pub.dropped == 1 and len(pub.pairs) == 0, "the lost fetcher's group was not dropped")
        f = TorchWeightFetcher(timeout_s=30)
        sd, version, _ = f.fetch(pub.publish(2, {"w": torch.arange(8.0)}))
        assert version == 2 and torch.equal(sd["w"], torch.arange(8.0))
        assert len(pub.pairs) == 1 and pub.pairs.made == 2
    finally:
        pub.close()


def test_a_fetcher_whose_publisher_dropped_the_pair_forms_a_new_one() -> None:
    pub = TorchWeightPublisher(keep=2, backend="gloo", timeout_s=30)
    f = TorchWeightFetcher(timeout_s=30)
    try:
        f.fetch(pub.publish(1, _state(1)))
        key = next(iter(pub.pairs.keys()))
        assert pub.pairs.drop(key)  # e.g. the publisher saw a broadcast fail that this fetcher never noticed
        sd, version, _ = f.fetch(pub.publish(2, _state(2)))
        assert version == 2 and torch.equal(sd["w"], _state(2)["w"])
        assert (f.pairs.made, f.pairs.destroyed, len(f.pairs)) == (2, 1, 1)  # the old one replaced, not kept
    finally:
        f.close()
        pub.close()


@pytest.mark.parametrize("failed", [False, True])
def test_destroy_group_calls_shutdown_or_abort(failed: bool) -> None:
    from libra.weights.pairs import destroy_group

    calls: list[str] = []

    class Group:
        def shutdown(self) -> None:
            calls.append("shutdown")

        def abort(self) -> None:
            calls.append("abort")

    destroy_group(Group(), failed=failed)
    assert calls == (["abort"] if failed else ["shutdown"])
