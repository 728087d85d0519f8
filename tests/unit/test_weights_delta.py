"""Delta weight sync's codec (libra.weights.delta) and the data-plane fetcher's choice between a delta and the
full object (libra.weights.dataplane, in process on loopback): bit-exact round trips in every dtype, each
encoding where it is the smallest, tied names, and every way a delta can be wrong raising DeltaMismatch or
falling back to the full object."""

from __future__ import annotations

import msgpack
import pytest
import torch

from libra.dataplane import DataPlaneServer
from libra.weights.dataplane import DataPlaneWeightFetcher, DataPlaneWeightPublisher
from libra.weights.delta import (
    DeltaMismatch,
    apply_delta,
    delta_enabled,
    delta_name,
    encode_delta,
    read_delta_header,
)
from libra.weights.format import WeightsFormatError, pack_state_dict
from libra.weights.host_copy import HostWeights
from libra.weights.packed import PackedWeights


def packed(sd: dict[str, torch.Tensor], version: int, chunk_size: int = 100) -> PackedWeights:
    return PackedWeights(*pack_state_dict(sd, version=version, chunk_size=chunk_size))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def same_bits(a: PackedWeights, b: PackedWeights) -> bool:
    return list(a) == list(b) and all(a.dtype(k) == b.dtype(k) and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 8, generator=g)
    return {"emb": emb, "bf": torch.randn(300, generator=g).bfloat16(), "half": torch.randn(40, generator=g).half(),
            "ids": torch.arange(50, dtype=torch.int64), "i8": torch.arange(-20, 20, dtype=torch.int8),
            "mask": torch.arange(33) % 3 == 0, "empty": torch.empty(0), "lm_head": emb}


def changed(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in sd.items()}
    out["lm_head"] = out["emb"]  # still tied
    out["emb"][5, 3] += 1.0  # one element of 512: delta-coded positions
    out["bf"][::2] += 1  # half of them: a bitmap
    out["ids"] += 1  # every element: dense
    out["i8"][7] = 99
    out["mask"][4] = True
    return out


@pytest.mark.parametrize("chunk_size", [7, 100, 1 << 20])
def test_a_delta_rebuilds_the_new_version_bit_for_bit(chunk_size: int) -> None:
    a, b = packed(state(), 1, chunk_size), packed(changed(state()), 2, chunk_size)
    header, chunks, summary = encode_delta(a, b, chunk_size=chunk_size)
    got = apply_delta(a, header, chunks)
    assert same_bits(got, b) and got.version == 2 and got.header_bytes == b.header_bytes
    assert got.alias_of("lm_head") == "emb" and torch.equal(got["lm_head"], got["emb"])
    encs = {t["name"]: t["enc"] for t in read_delta_header(header).tensors}
    assert encs == {"emb": "gaps", "bf": "bitmap", "half": "same", "ids": "dense", "i8": "gaps", "mask": "gaps",
                    "empty": "same"}  # lm_head is tied: it travels in the full header only
    assert summary.tensors == 7 and summary.unchanged_tensors == 2 and summary.delta_bytes == len(header) + sum(
        len(c) for c in chunks) and sum(len(c) for c in chunks) < summary.full_bytes
    assert summary.elements == 512 + 300 + 40 + 50 + 40 + 33
    assert summary.elements - summary.unchanged_elements == 1 + 150 + 50 + 1 + 1


def test_bit_patterns_not_values_decide_what_changed() -> None:
    base = {"z": torch.zeros(64), "n": torch.full((64,), float("nan"))}
    new = {"z": torch.zeros(64), "n": base["n"].clone()}
    new["z"][3] = -0.0  # equal as a float, another bit pattern
    new["n"].view(torch.int32)[9] ^= 1  # another NaN payload
    a, b = packed(base, 1), packed(new, 2)
    header, chunks, summary = encode_delta(a, b)
    assert summary.unchanged_elements == 126 and same_bits(apply_delta(a, header, chunks), b)


def test_an_unchanged_version_is_a_delta_of_no_payload_and_a_new_tensor_goes_dense() -> None:
    a = packed(state(), 1)
    header, chunks, summary = encode_delta(a, packed(state(), 2))
    assert chunks == [] and summary.unchanged_tensors == summary.tensors
    grown = {**state(), "emb": torch.randn(65, 8), "new": torch.ones(3)}  # reshaped, and a name the base lacks
    b = packed(grown, 3)
    header, chunks, _ = encode_delta(a, b)
    assert {t["name"]: t["enc"] for t in read_delta_header(header).tensors}["new"] == "dense"
    assert same_bits(apply_delta(a, header, chunks), b)


def test_a_delta_on_another_base_or_corrupted_raises_delta_mismatch() -> None:
    a, b = packed(state(), 1), packed(changed(state()), 2)
    header, chunks, _ = encode_delta(a, b, chunk_size=64)
    with pytest.raises(DeltaMismatch, match="applies to version 1"):  # same version number, other bytes
        apply_delta(packed(state(seed=9), 1), header, chunks)
    with pytest.raises(DeltaMismatch, match="applies to version 1"):
        apply_delta(b, header, chunks)
    bad = [bytes([chunks[0][0] ^ 1]) + chunks[0][1:], *chunks[1:]]
    with pytest.raises(DeltaMismatch, match="CRC-32"):
        apply_delta(a, header, bad)
    with pytest.raises(DeltaMismatch, match="chunks"):
        apply_delta(a, header, chunks[:-1])
    with pytest.raises(DeltaMismatch, match="format"):
        apply_delta(a, msgpack.packb({"format": "something/9"}), chunks)
    assert issubclass(DeltaMismatch, WeightsFormatError)


def forged(header: bytes, name: str, **fields: object) -> bytes:
    raw = msgpack.unpackb(header, raw=False)
    for t in raw["tensors"]:
        if t["name"] == name:
            t.update(fields)
    return msgpack.packb(raw, use_bin_type=True)


def test_a_record_whose_result_differs_fails_its_checksum_never_a_silently_wrong_tensor() -> None:
    a, b = packed(state(), 1), packed(changed(state()), 2)
    header, chunks, _ = encode_delta(a, b)
    with pytest.raises(DeltaMismatch, match="'half'.*CRC-32"):  # a record that says 'same' for a changed result
        apply_delta(a, forged(header, "half", crc32=12345), chunks)
    lying = forged(header, "emb", count=2)
    with pytest.raises(DeltaMismatch, match="'emb'"):
        apply_delta(a, lying, chunks)
    no_base = packed({k: v for k, v in state().items() if k != "half"}, 1)
    h2, c2, _ = encode_delta(a, b)
    raw = msgpack.unpackb(h2, raw=False)
    raw["base_digest"] = msgpack.unpackb(encode_delta(no_base, b)[0], raw=False)["base_digest"]
    with pytest.raises(DeltaMismatch, match="'half': the base holds no"):
        apply_delta(no_base, msgpack.packb(raw, use_bin_type=True), c2)


def test_delta_sync_is_on_by_default_and_a_bad_setting_is_refused() -> None:
    assert delta_enabled({}) and delta_enabled({"LIBRA_WEIGHTS_DELTA": "1"})
    assert not delta_enabled({"LIBRA_WEIGHTS_DELTA": "0"})
    with pytest.raises(ValueError, match="LIBRA_WEIGHTS_DELTA"):
        delta_enabled({"LIBRA_WEIGHTS_DELTA": "maybe"})
    assert delta_name(7, 6) == "weights/v7/from/v6"


def test_the_fetcher_takes_the_delta_only_from_the_version_it_holds() -> None:
    big = {"w": torch.randn(4096), "b": torch.zeros(16)}
    with DataPlaneServer() as server:
        pub = DataPlaneWeightPublisher(server, keep=2, chunk_size=1024, delta=True)
        versions = [{k: v.clone() for k, v in big.items()} for _ in range(4)]
        for i, sd in enumerate(versions[1:], 1):
            sd["w"][: 10 * i] += 1.0
        refs = [pub.publish(1, versions[0]), pub.publish(2, versions[1])]
        assert "delta_from" not in refs[0] and refs[1]["delta_from"] == 1 and refs[1]["delta_bytes"] > 0
        assert delta_name(2, 1) in server.names() and latest_name(server) == "weights/v2"
        held = HostWeights()
        f = DataPlaneWeightFetcher(host_copy=held)
        sd, v, st = f.fetch(refs[0])
        assert (v, st.mode, held.version) == (1, "full", 1)
        sd, v, st = f.fetch(refs[1])
        full2 = DataPlaneWeightFetcher().fetch(refs[1])[0]
        assert (v, st.mode, held.version) == (2, "delta", 2) and same_bits(sd, full2)
        assert st.nbytes + st.header_bytes < refs[1]["bytes"] and st.delta_error is None
        refs += [pub.publish(3, versions[2]), pub.publish(4, versions[3])]
        sd, v, st = f.fetch(refs[3])  # holds v2, the delta is from v3: the full object
        assert (v, st.mode, st.delta_error) == (4, "full", None) and same_bits(sd, full2) is False
        sd, v, st = f.fetch(refs[3])  # held already: from host memory, no bytes
        assert (v, st.mode, st.nbytes) == (4, "host", 0)


def latest_name(server: DataPlaneServer) -> str:
    from libra.dataplane import latest

    ref = latest(server.endpoint, "weights")
    assert ref is not None
    return ref.name


def test_a_delta_that_fails_falls_back_to_the_full_object() -> None:
    with DataPlaneServer() as server:
        pub = DataPlaneWeightPublisher(server, chunk_size=256, delta=True)
        one = {"w": torch.arange(1000, dtype=torch.float32)}
        two = {"w": one["w"].clone()}
        two["w"][3] = -1
        r1, r2 = pub.publish(1, one), pub.publish(2, two)
        held = HostWeights()
        f = DataPlaneWeightFetcher(host_copy=held)
        f.fetch(r1)
        server.retire(delta_name(2, 1))  # gone (or never served): the full object
        sd, v, st = f.fetch(r2)
        assert (v, st.mode) == (2, "full") and "ObjectNotFound" in str(st.delta_error)
        assert torch.equal(sd["w"], two["w"]) and st.nbytes == 4000 and st.header_bytes > 0
        # a base that is not what the trainer published as v1 (another trainer's, same version number)
        held.put(r1["endpoint"], packed({"w": torch.zeros(1000)}, 1))
        server.publish(delta_name(2, 1), *encode_delta(packed(one, 1, 256), packed(two, 2, 256))[:2], version=2)
        sd, v, st = f.fetch(r2)
        assert (v, st.mode) == (2, "full") and "DeltaMismatch" in str(st.delta_error)
        assert torch.equal(sd["w"], two["w"]) and held.version == 2


def test_a_publisher_serves_no_delta_that_would_not_pay_and_none_when_off() -> None:
    with DataPlaneServer() as server:
        pub = DataPlaneWeightPublisher(server, delta=True)
        pub.publish(1, {"w": torch.randn(256)})
        assert "delta_from" not in pub.publish(2, {"w": torch.randn(256)})  # every element changed
        assert pub.last_delta is not None and pub.last_delta.unchanged_elements == 0
        assert server.names() == ["weights/v1", "weights/v2"]
        off = DataPlaneWeightPublisher(server, delta=False)
        off.publish(3, {"w": torch.zeros(256)})
        assert "delta_from" not in off.publish(4, {"w": torch.zeros(256)}) and off.last_delta is None


def test_a_weights_ref_names_its_delta_base_and_an_old_ref_without_one_still_reads() -> None:
    from libra.protocol.payloads_base import PayloadError
    from libra.protocol.payloads_refs import WeightsRef

    old = {"version": 3, "endpoint": "tcp://127.0.0.1:5", "name": "weights/v3", "server_key": None, "bytes": 10}
    assert WeightsRef.from_wire(old).delta_from is None and WeightsRef.from_wire(old).to_wire() == old
    new = WeightsRef.from_wire({**old, "delta_from": 2, "delta_bytes": 4})
    assert (new.delta_from, new.delta_bytes) == (2, 4) and new.to_wire()["delta_from"] == 2
    with pytest.raises(PayloadError, match="delta_from"):
        WeightsRef.from_wire({**old, "delta_from": 3})
    with pytest.raises(PayloadError, match="delta_from"):
        WeightsRef.from_wire({**old, "delta_from": "2"})


def test_a_publisher_stops_encoding_deltas_that_never_pay_and_probes_again() -> None:
    """An fp32 export changes nearly every element each step: after two unserved deltas the publisher stops
    paying the encode (0.3-0.6 s a step for SmolLM2-135M on a CPU trainer), and tries again every 16th version."""
    with DataPlaneServer() as server:
        pub = DataPlaneWeightPublisher(server, delta=True)
        for v in range(1, 4):
            pub.publish(v, {"w": torch.randn(256)})
        assert (pub.unserved, pub.skipped) == (2, 0)
        pub.publish(4, {"w": torch.randn(256)})
        assert pub.skipped == 1 and pub.last_delta is not None
        same = torch.zeros(256)
        for v in range(5, 16):
            pub.publish(v, {"w": same})
        assert pub.skipped == 12
        assert "delta_from" in pub.publish(16, {"w": same})  # probed: an unchanged tensor pays, served again
        assert pub.unserved == 0 and "delta_from" in pub.publish(17, {"w": same})


def test_a_slot_keeps_no_host_copy_while_the_trainer_serves_no_deltas() -> None:
    """fp32 versions: the publisher stops serving deltas, its refs stop saying ``deltas``, and a fetcher drops the
    copy it held (a CPU rollout slot would otherwise hold a second model it never uses)."""
    with DataPlaneServer() as server:
        pub = DataPlaneWeightPublisher(server, delta=True)
        held = HostWeights()
        f = DataPlaneWeightFetcher(host_copy=held)
        refs = [pub.publish(v, {"w": torch.randn(256)}) for v in range(1, 5)]
        assert [bool(r.get("deltas")) for r in refs] == [True, True, True, False]
        f.fetch(refs[2])
        assert held.get(server.endpoint) is not None
        f.fetch(refs[3])
        assert held.get(server.endpoint) is None
