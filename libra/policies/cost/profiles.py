"""Hardware and model profiles for the cost models, loaded from the TOML files in ``profiles/``.

Role: one typed, validated description of a device (:class:`HardwareProfile`, with the effective
serving and training coefficients calibrated for it) and of a model (:class:`ModelProfile`, dense or
MoE). The cost models (``cost/rollout.py``, ``cost/training.py``) read nothing else.

Contracts:

- :func:`load_hardware` / :func:`load_model` take a bundled profile name (``a800``, ``h100``,
  ``h200``, ``cpu``; ``qwen3-4b``, ``qwen3-14b``, ``qwen3-30b-a3b``, ``tiny``; case-insensitive)
  or a path to a ``.toml`` file. An unknown name raises :class:`ProfileError` listing the known
  names; a malformed file, a missing field, a wrong type or an out-of-range value raises
  :class:`ProfileError` naming the file and the field.
- Profiles are frozen dataclasses; ``dataclasses.replace`` makes variants (tests, what-if runs).
- Pure: no I/O beyond reading the requested file, no global mutable state.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "HardwareProfile",
    "ModelProfile",
    "ProfileError",
    "RolloutCalibration",
    "TrainingCalibration",
    "known_hardware",
    "known_models",
    "load_hardware",
    "load_model",
]

PROFILE_DIR = Path(__file__).resolve().parent / "data"


class ProfileError(ValueError):
    """A profile name is unknown, or a profile file is malformed (the message names file and field)."""


@dataclass(frozen=True, slots=True)
class RolloutCalibration:
    """Effective coefficients of the rollout (serving) cost model on one device type.

    ``gpu_memory_utilization`` is the fraction of device memory the engine may use (weights + KV);
    ``kv_fragmentation`` the fraction of the KV pool lost to paging; ``prefill_mfu`` the prefill
    model-FLOPs utilisation; ``decode_bw_util`` the fraction of HBM bandwidth a decode step achieves; ``decode_mfu`` the
    fraction of peak FLOP/s a compute-bound decode step achieves (the roofline's other arm);
    ``per_step_overhead_s`` CPU time per decode step independent of the batch (launch, scheduler loop);
    ``tp_comm_overhead_s`` the latency of one TP all-reduce (two per layer per step);
    ``per_seq_step_overhead_s`` CPU time per running sequence per decode step (scheduler, sampler);
    ``per_request_overhead_s`` time an instance spends serially on each request outside the batched
    GPU work, stalling every sequence on it (0 in the bundled GPU profiles: docs/papers.md §1.7 says per-turn
    serving overhead is latency of that trajectory only); ``per_turn_latency_s`` that per-turn latency
    (admission, tokenisation, HTTP, agent round trip), which delays only the turn's own trajectory and
    costs the instance nothing; ``max_batch`` the engine's concurrent
    sequence cap; ``kv_reserve_gen_fraction`` the share of a request's generation whose KV the
    admission control reserves (0.5: the average in-flight size, 1.0: the full length).
    """

    gpu_memory_utilization: float = 0.9
    kv_fragmentation: float = 0.04
    activation_workspace_bytes: float = 1e9
    prefill_mfu: float = 0.55
    decode_bw_util: float = 0.85
    decode_mfu: float = 0.5
    tp_comm_overhead_s: float = 8e-6
    per_step_overhead_s: float = 0.0
    per_seq_step_overhead_s: float = 0.0
    per_request_overhead_s: float = 0.0
    per_turn_latency_s: float = 0.0
    max_batch: int = 256
    kv_reserve_gen_fraction: float = 0.5


@dataclass(frozen=True, slots=True)
class TrainingCalibration:
    """Effective coefficients for deriving training costs on one device type.

    ``mfu``: achieved fraction of peak FLOP/s for the GEMMs; ``attention_slowdown``: how much slower
    than its FLOP count the attention core (the L^2 part) runs; ``mem_fraction``: usable share of
    device memory for the training memory model; ``export_weights`` (1 or 0): each step ends by streaming
    the new weights to the rollout side (``params * dtype_bytes / bw_inter``, a fixed per-step cost).
    """

    mfu: float = 0.4
    attention_slowdown: float = 1.0
    mem_fraction: float = 0.95
    export_weights: int = 1


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One accelerator type and its node: peak FLOP/s, HBM bandwidth and size, link bandwidths.

    Units: FLOP/s, bytes/s, bytes. ``gpus_per_node`` bounds TP and EP (kept inside a node).
    """

    name: str
    flops_peak: float
    mem_bw: float
    mem_bytes: float
    bw_intra: float
    bw_inter: float
    gpus_per_node: int
    description: str = ""
    rollout: RolloutCalibration = field(default_factory=RolloutCalibration)
    training: TrainingCalibration = field(default_factory=TrainingCalibration)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A decoder-only transformer: shape, parameter counts and (for MoE) the expert layout.

    ``params`` is every stored parameter (all experts); ``active_params`` the parameters one token
    touches (equal to ``params`` for a dense model). ``n_experts == 0`` means dense.
    """

    name: str
    params: float
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tie_embeddings: bool = False
    active_params: float = 0.0
    n_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0

    def __post_init__(self) -> None:
        if self.active_params <= 0:
            object.__setattr__(self, "active_params", float(self.params))

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        """Width of the attention query projection (``n_heads * head_dim``)."""
        return self.n_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> float:
        """Q, K, V and O projection parameters of one layer."""
        kv = self.n_kv_heads * self.head_dim
        return float(self.hidden * (2 * self.q_dim + 2 * kv))

    @property
    def expert_params_per_layer(self) -> float:
        """Parameters of all routed experts of one layer (0 for a dense model)."""
        return float(self.n_experts * 3 * self.hidden * self.expert_intermediate) if self.is_moe else 0.0

    @property
    def mlp_active_params_per_layer(self) -> float:
        """FFN parameters one token uses in one layer (its routed experts for MoE)."""
        if self.is_moe:
            return float(self.experts_per_token * 3 * self.hidden * self.expert_intermediate)
        return float(3 * self.hidden * self.intermediate)

    @property
    def dense_params(self) -> float:
        """Parameters outside the routed experts (all of them for a dense model)."""
        return float(self.params) - self.n_layers * self.expert_params_per_layer

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """KV-cache bytes one token occupies on each GPU of a TP group of size ``tp``.

        KV heads are split across TP ranks; when ``tp`` exceeds the KV head count each rank keeps a
        replica of one head, so the per-GPU size stops shrinking.
        """
        heads = max(1, math.ceil(self.n_kv_heads / tp))
        return float(2 * self.n_layers * heads * self.head_dim * self.dtype_bytes)


_HW_FIELDS: dict[str, type] = {
    "name": str,
    "flops_peak": float,
    "mem_bw": float,
    "mem_bytes": float,
    "bw_intra": float,
    "bw_inter": float,
    "gpus_per_node": int,
}
_MODEL_FIELDS: dict[str, type] = {
    "name": str,
    "params": float,
    "n_layers": int,
    "hidden": int,
    "n_heads": int,
    "n_kv_heads": int,
    "head_dim": int,
    "intermediate": int,
    "vocab": int,
}
_MOE_FIELDS: dict[str, type] = {"n_experts": int, "experts_per_token": int, "expert_intermediate": int}


def known_hardware() -> list[str]:
    """Names of the bundled hardware profiles, sorted."""
    return sorted(p.stem for p in (PROFILE_DIR / "hardware").glob("*.toml"))


def known_models() -> list[str]:
    """Names of the bundled model profiles, sorted."""
    return sorted(p.stem for p in (PROFILE_DIR / "models").glob("*.toml"))


def _resolve(name: str | Path, kind: str, known: list[str]) -> Path:
    text = str(name)
    if text.endswith(".toml") or "/" in text or "\\" in text:
        path = Path(text)
        if not path.is_file():
            raise ProfileError(f"{kind} profile file not found: {text!r}")
        return path
    key = text.strip().lower()
    if key not in known:
        raise ProfileError(f"unknown {kind} profile: {text!r} (known: {', '.join(known)})")
    return PROFILE_DIR / ("hardware" if kind == "hardware" else "models") / f"{key}.toml"


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from exc
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc}") from exc


def _coerce(path: Path, where: str, key: str, value: Any, typ: type) -> Any:
    if typ is str:
        if not isinstance(value, str) or not value:
            raise ProfileError(f"{path}: {where}{key} must be a non-empty string, got {value!r}")
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise ProfileError(f"{path}: {where}{key} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{path}: {where}{key} must be a number, got {value!r}")
    if typ is int:
        if float(value) != int(value):
            raise ProfileError(f"{path}: {where}{key} must be an integer, got {value!r}")
        value = int(value)
    else:
        value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ProfileError(f"{path}: {where}{key} must be a finite number >= 0, got {value!r}")
    return value


def _take(path: Path, table: dict[str, Any], spec: dict[str, type], where: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, typ in spec.items():
        if key not in table:
            raise ProfileError(f"{path}: missing field {where}{key}")
        out[key] = _coerce(path, where, key, table[key], typ)
    return out


def _section(path: Path, data: dict[str, Any], name: str, cls: type) -> Any:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ProfileError(f"{path}: [{name}] must be a table")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ProfileError(f"{path}: unknown field {name}.{key} (known: {', '.join(sorted(known))})")
        typ = int if known[key].type in ("int", int) else float
        kwargs[key] = _coerce(path, f"{name}.", key, value, typ)
    return cls(**kwargs)


def load_hardware(name: str | Path) -> HardwareProfile:
    """Load a hardware profile by bundled name or TOML path.

    Raises :class:`ProfileError` on an unknown name or a bad file (naming the file and field).
    """
    path = _resolve(name, "hardware", known_hardware())
    data = _read(path)
    base = _take(path, data, _HW_FIELDS)
    for key in ("flops_peak", "mem_bw", "mem_bytes", "bw_intra", "bw_inter", "gpus_per_node"):
        if base[key] <= 0:
            raise ProfileError(f"{path}: {key} must be > 0, got {base[key]!r}")
    rollout = _section(path, data, "rollout", RolloutCalibration)
    training = _section(path, data, "training", TrainingCalibration)
    if not 0 < rollout.gpu_memory_utilization <= 1:
        raise ProfileError(f"{path}: rollout.gpu_memory_utilization must be in (0, 1]")
    if rollout.decode_bw_util <= 0 or rollout.prefill_mfu <= 0 or rollout.decode_mfu <= 0 or rollout.max_batch < 1:
        raise ProfileError(f"{path}: rollout.decode_bw_util, prefill_mfu, decode_mfu must be > 0 and max_batch >= 1")
    if rollout.per_step_overhead_s < 0 or rollout.per_seq_step_overhead_s < 0:
        raise ProfileError(f"{path}: rollout.per_step_overhead_s, per_seq_step_overhead_s must be >= 0")
    if training.mfu <= 0 or training.attention_slowdown <= 0 or not 0 < training.mem_fraction <= 1:
        raise ProfileError(f"{path}: training.mfu, attention_slowdown must be > 0, mem_fraction in (0, 1]")
    desc = data.get("description", "")
    return HardwareProfile(**base, description=str(desc), rollout=rollout, training=training)


def load_model(name: str | Path) -> ModelProfile:
    """Load a model profile by bundled name or TOML path.

    Raises :class:`ProfileError` on an unknown name or a bad file (naming the file and field).
    """
    path = _resolve(name, "model", known_models())
    data = _read(path)
    base = _take(path, data, _MODEL_FIELDS)
    for key, value in base.items():
        if key != "name" and value <= 0:
            raise ProfileError(f"{path}: {key} must be > 0, got {value!r}")
    extra: dict[str, Any] = {}
    for key, typ in (("dtype_bytes", int), ("tie_embeddings", bool), ("active_params", float)):
        if key in data:
            extra[key] = _coerce(path, "", key, data[key], typ)
    if "moe" in data:
        if not isinstance(data["moe"], dict):
            raise ProfileError(f"{path}: [moe] must be a table")
        extra.update(_take(path, data["moe"], _MOE_FIELDS, "moe."))
        if not 0 < extra["experts_per_token"] <= extra["n_experts"]:
            raise ProfileError(f"{path}: moe.experts_per_token must be in [1, n_experts]")
    if base["n_heads"] % base["n_kv_heads"]:
        raise ProfileError(f"{path}: n_heads ({base['n_heads']}) must be a multiple of n_kv_heads")
    model = ModelProfile(**base, **extra)
    if model.active_params > model.params or model.dense_params <= 0:
        raise ProfileError(f"{path}: active_params/expert sizes inconsistent with params={model.params:g}")
    return model
