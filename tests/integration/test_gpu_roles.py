"""Engine slots asked for on GPUs (``libra actors --gpu-roles rollout=1``), real processes on loopback: on a
host with a GPU the slot is ``gpu0`` and its turns come from the GPU; on a CPU-only host it falls back to a CPU
slot and serves the same turns. Either way a generate turn round-trips through the broker."""

from __future__ import annotations

import pytest

from libra.client import Client
from libra.engines.tiny_model import ensure_tiny_model
from libra.local import LocalCluster

pytestmark = pytest.mark.integration


def test_gpu_engine_slots_serve_turns_on_the_gpu_or_fall_back_to_the_cpu(tmp_path) -> None:
    import torch

    model = ensure_tiny_model(tmp_path / "tiny")
    cluster = LocalCluster(cpu_slots=0, gpu_slots="auto",
                           actor_args=["--gpu-roles", "rollout=1", "--model-dir", str(model), "--rollout-batch", "4",
                                       "--torch-threads", "1", "--no-restart"])
    cluster.start(wait_actors=1, timeout=300.0)
    try:
        with Client(cluster.url) as c:
            (actor,) = c.status().actors
            assert actor["slot"] == ("gpu0" if torch.cuda.is_available() else "cpu0")
            assert actor["kinds"] == ["generate"]
            r = c.request("generate", "", {"prompt_ids": [5, 6, 7], "max_new_tokens": 4, "temperature": 0.0},
                          timeout=120)
            assert len(r.output["token_ids"]) == 4 and r.output["gen_tokens"] == 4
    finally:
        cluster.stop()
