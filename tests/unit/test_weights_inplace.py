"""Weights in place: tied weights shipped once, a received version decoded straight into the rollout model's
own tensors (libra.weights.packed), refusals kept."""

from __future__ import annotations

import pytest
import torch

from libra.dataplane import DataPlaneServer
from libra.engines.hf_rollout import HFRolloutEngine, _names_to_write
from libra.engines.rollout_base import WeightsMismatch
from libra.weights.dataplane import DataPlaneWeightFetcher, DataPlaneWeightPublisher
from libra.weights.format import WeightsFormatError, pack_state_dict, read_header, tie_like, unpack_state_dict
from libra.weights.packed import PackedWeights

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tied_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def sync_copy(model) -> dict[str, torch.Tensor]:
    """What a trainer publishes: CPU copies, tied weights tied again."""
    return tie_like(model.state_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()})


def test_a_tied_weight_is_shipped_once_and_unpacked_tied():
    src = sync_copy(tied_model(1))
    assert src[HEAD] is src[EMBED]
    header, chunks = pack_state_dict(src, version=3, chunk_size=1000)
    hdr = read_header(header)
    aliases = {e["name"]: e["alias"] for e in hdr.tensors if "alias" in e}
    assert aliases == {HEAD: EMBED}
    untied = {k: v.clone() for k, v in src.items()}  # the same values, two memories: shipped twice
    assert read_header(pack_state_dict(untied)[0]).total_bytes == hdr.total_bytes + src[EMBED].numel() * 4
    out, _ = unpack_state_dict(header, chunks)
    assert out[HEAD] is out[EMBED]
    for k, v in src.items():
        assert torch.equal(out[k], v)


def test_an_alias_naming_no_earlier_tensor_or_another_shape_is_refused():
    import msgpack

    header, _ = pack_state_dict(sync_copy(tied_model(1)))
    raw = msgpack.unpackb(header)
    for e in raw["tensors"]:
        if "alias" in e:
            e["alias"] = "model.norm.weight"  # exists, but of another shape
    with pytest.raises(WeightsFormatError, match="alias of 'model.norm.weight'"):
        read_header(msgpack.packb(raw))
    for e in raw["tensors"]:
        if "alias" in e:
            e["alias"] = "nowhere"
    with pytest.raises(WeightsFormatError, match="not an earlier tensor"):
        read_header(msgpack.packb(raw))


def test_packed_weights_decode_exactly_across_chunk_edges_and_refuse_corruption():
    src = sync_copy(tied_model(2))
    header, chunks = pack_state_dict(src, chunk_size=37)  # tensors straddle chunk edges at odd offsets
    pw = PackedWeights(header, chunks)
    assert list(pw) == list(src)
    for k, v in src.items():
        dest = torch.empty_like(v)
        pw.copy_into(k, dest)
        assert torch.equal(dest, v), k
        assert torch.equal(pw[k], v), k
    assert pw[HEAD] is pw[EMBED]
    with pytest.raises(ValueError, match="shape"):
        pw.copy_into(EMBED, torch.empty(3, 3))
    bad = [bytearray(c) for c in chunks]
    bad[5][0] ^= 0xFF
    with pytest.raises(WeightsFormatError, match="chunk 5 failed its CRC-32"):
        PackedWeights(header, bad)


def test_packed_weights_convert_dtype_when_the_destination_differs():
    src = sync_copy(tied_model(2))
    pw = PackedWeights(*pack_state_dict(src))
    dest = torch.empty(src[EMBED].shape, dtype=torch.bfloat16)
    pw.copy_into(EMBED, dest)
    assert torch.equal(dest, src[EMBED].to(torch.bfloat16))


@pytest.mark.parametrize("packed", [True, False])
def test_load_in_place_gives_the_new_weights_exactly_keeps_ties_and_rebuilds_nothing(packed):
    engine = HFRolloutEngine.from_model(tied_model(1))
    before = {k: v.data_ptr() for k, v in engine.model.state_dict().items()}
    params = [id(p) for p in engine.model.parameters()]
    new = sync_copy(tied_model(7))
    sd = PackedWeights(*pack_state_dict(new, version=1)) if packed else new
    engine.load_weights(1, sd)
    own = engine.model.state_dict()
    for k, v in new.items():
        assert torch.equal(own[k], v), k
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still one tensor
    assert {k: v.data_ptr() for k, v in own.items()} == before  # written into the same memory
    assert [id(p) for p in engine.model.parameters()] == params
    assert engine.weights_version == 1


def test_the_tied_name_is_written_once_and_an_untied_source_writes_both():
    model = tied_model(1)
    own = model.state_dict()
    tied = sync_copy(tied_model(3))
    assert HEAD not in _names_to_write(own, tied) and EMBED in _names_to_write(own, tied)
    assert HEAD not in _names_to_write(own, PackedWeights(*pack_state_dict(tied)))
    untied = {k: v.clone() for k, v in tied.items()}
    assert {HEAD, EMBED} <= set(_names_to_write(own, untied))


def test_a_shape_or_name_mismatch_is_still_refused_and_leaves_the_weights():
    engine = HFRolloutEngine.from_model(tied_model(1))
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    wrong = sync_copy(tied_model(7))
    wrong["model.norm.weight"] = torch.ones(5)
    with pytest.raises(WeightsMismatch, match="model.norm.weight"):
        engine.load_weights(1, PackedWeights(*pack_state_dict(wrong)))
    missing = sync_copy(tied_model(7))
    del missing["model.norm.weight"]
    with pytest.raises(WeightsMismatch, match="missing"):
        engine.load_weights(1, PackedWeights(*pack_state_dict(missing)))
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, old[k]), k
    assert engine.weights_version == 0


def test_the_data_plane_fetcher_returns_packed_weights_that_load_in_place():
    new = sync_copy(tied_model(9))
    with DataPlaneServer() as server:
        ref = DataPlaneWeightPublisher(server).publish(4, new)
        sd, version, stats = DataPlaneWeightFetcher().fetch(ref)
    assert isinstance(sd, PackedWeights) and version == 4
    assert stats.nbytes == sum(v.numel() * 4 for k, v in new.items() if k != HEAD)  # the tied weight once
    engine = HFRolloutEngine.from_model(tied_model(1))
    engine.load_weights(version, sd)
    for k, v in new.items():
        assert torch.equal(engine.model.state_dict()[k], v), k


def test_the_weights_apply_bench_checks_both_paths_on_the_tiny_model():
    from libra.bench.weights_apply import run

    out = run("tiny", repeat=1)  # it raises if either path leaves the model without the published weights
    assert out["before"]["bytes"] == out["in_place"]["bytes"] > 0  # the tiny model ties nothing
    assert out["bytes_ratio"] == 1.0


def test_the_trainer_publishes_its_own_tensors_tied_and_the_publisher_copies_them(tmp_path):
    from libra.engines.trainer import GRPOConfig, GRPOTrainer

    tied_model(4).save_pretrained(tmp_path)
    trainer = GRPOTrainer(tmp_path, GRPOConfig())
    live = trainer.state_dict_for_sync(copy=False)
    own = trainer.model.state_dict()
    assert all(live[k].data_ptr() == own[k].data_ptr() for k in own)  # no copy on a CPU fp32 replica
    copies = trainer.state_dict_for_sync()
    assert copies[HEAD] is copies[EMBED] and copies[EMBED].data_ptr() != own[EMBED].data_ptr()
    with DataPlaneServer() as server:
        ref = DataPlaneWeightPublisher(server).publish(1, live)
        want = {k: v.clone() for k, v in live.items()}
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1.0)  # training goes on after the publish
        sd, _, stats = DataPlaneWeightFetcher().fetch(ref)
    assert stats.nbytes == sum(v.numel() * 4 for k, v in want.items() if k != HEAD)
    for k, v in want.items():
        assert torch.equal(sd[k], v), k
