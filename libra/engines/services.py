"""GPU resource manager for model services (ARL-Tangram §2.5 "evict on execution"), driven by
:class:`~libra.policies.actions.gpu_services.ServicePlacement`.

A *service* (a reward model first) is registered once with a **host-memory copy** of its weights (every
parameter and buffer as a CPU tensor; pinned when CUDA is in use). A service is either *resident* (one or
more replicas whose tensors live on a device chunk) or *evicted* (its replicas' tensors are ``meta``
tensors: no storage). :meth:`ServiceManager.score` places the call through the pure placement policy:

1. an idle resident replica (a hit: no copy);
2. else a restore into a free aligned chunk from the multi-level-cell allocator (host → device copy);
3. else the least-recently-used idle replicas of one chunk are evicted first, then the restore;
4. else (every chunk busy) the call waits for a release, up to ``wait_s``, then fails with ``busy``.

Devices. With CUDA (``device="auto"`` on a GPU host, or ``"cuda"``) the allocator covers the visible GPUs
(nodes of 8) and a replica lives on the first GPU of its chunk (``cuda:<8·node + gpu>``; a multi-GPU
service is not sharded yet). On CPU the same code runs with "device memory" simulated as ``budget`` chunks
of one GPU each: a resident replica holds a separate CPU copy of the weights (restore really copies every
tensor, evict really frees them), so restore/evict/LRU are tested for real on any machine.

Score. A causal LM scores ``text`` by its mean per-token log-probability (``log p(t_i | t_<i)``, i ≥ 1),
computed under ``torch.inference_mode``; scores are bit-identical before and after an evict + restore.

Thread safety: every public method may be called from many threads. The placement state and the replica
table are guarded by one lock; copies and forward passes run outside it (a busy replica is never evicted).

Errors: :class:`UnknownService` (``code == "unknown_service"``) names the known services;
:class:`ServiceError` with ``code`` ``bad_request`` / ``busy`` for a bad argument or a pool that stayed full.

Placed by the broker. When the broker's action placement decides (``action_scheduler`` set and this actor
reports ``gpus`` in its hello labels), each call's ``Assign.route`` carries a
:class:`~libra.protocol.payloads_actions.ServiceRoute` and :meth:`ServiceManager.score_at` obeys it instead of
the local placement: the idle replicas it lists are evicted (with exclusive cells, any other replica on the
target cell too; under the broker's GPU memory model, ``shared``, replicas of several services stay on one
cell), the service's replica on its cell is used as it is (a hit) or restored from host memory, and the
answer names the cell. Replicas are kept per (cell, service), so a broker whose view was lost (a restart)
converges by its next routes; a call never evicts a replica on a cell another call is executing on (it
waits up to ``wait_s``, then fails with ``busy``).

Actor tool: :func:`service_tools` returns ``{"reward_model": handler}`` (args ``{"service": name, "text":
str}`` → ``{"service", "score", "tokens", "restored", "evicted", "device"}``, plus ``"cell"`` and
``"replica"`` when the broker placed it). Its default manager is built
lazily on the first call with the bundled tiny model as service ``tiny_reward`` plus every
``name=path`` in ``LIBRA_REWARD_MODELS`` (``;``-separated Hugging Face causal-LM directories).
"""

from __future__ import annotations

import copy
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from libra.logging import get_logger
from libra.policies.actions.gpu_services import ServicePlacement, ServiceSpec
from libra.policies.actions.gpu_cells import Allocation, MultiLevelCellAllocator
from libra.protocol.payloads_actions import Cell, ServiceRoute

__all__ = ["ServiceError", "ServiceManager", "UnknownService", "service_tools"]

log = get_logger("libra.engines.services")

_Slot = tuple[torch.nn.Module, str, str]  # (module, "_parameters" | "_buffers", attribute name)


class ServiceError(RuntimeError):
    """A service call failed; ``code`` is ``bad_request``, ``busy`` or ``unknown_service``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class UnknownService(ServiceError):
    """No service of that name is registered."""

    def __init__(self, name: object, known: Iterable[str]) -> None:
        names = ", ".join(sorted(known)) or "none"
        super().__init__("unknown_service", f"unknown service {name!r} (registered services: {names})")


def _tensor_slots(model: torch.nn.Module) -> dict[str, list[_Slot]]:
    """Every place a tensor is registered, grouped by tensor identity and keyed by its first qualified name
    (tied weights share one key, so they stay tied after a restore)."""
    by_id: dict[int, str] = {}
    slots: dict[str, list[_Slot]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, t in getattr(mod, kind).items():
                if t is None:
                    continue
                key = by_id.setdefault(id(t), f"{mod_name}.{attr}" if mod_name else attr)
                slots.setdefault(key, []).append((mod, kind, attr))
    return slots


def _assign(slots: list[_Slot], tensor: torch.Tensor) -> None:
    value: torch.Tensor = torch.nn.Parameter(tensor, requires_grad=False) if slots[0][1] == "_parameters" else tensor
    for mod, kind, attr in slots:
        getattr(mod, kind)[attr] = value


@dataclass(slots=True)
class _Service:
    spec: ServiceSpec
    host: dict[str, torch.Tensor]  # key -> CPU tensor (the host-memory copy)
    skeleton: torch.nn.Module  # the model with meta tensors; replicas are deep copies
    tokenizer: Any
    max_tokens: int


@dataclass(slots=True)
class _Replica:
    service: str
    model: torch.nn.Module
    slots: dict[str, list[_Slot]]
    device: torch.device
    resident: bool = False


class ServiceManager:
    """Evict-on-execution manager of model services (see the module docstring).

    ``device``: ``"auto"`` (CUDA if available), ``"cuda"`` or ``"cpu"``. ``budget``: on CPU, how many
    one-GPU chunks are simulated (= resident replicas of one-GPU services); on CUDA, the number of GPUs to
    use (default: all visible). ``max_replicas`` caps resident replicas per service (``None``: as many as
    chunks allow). ``wait_s``: how long a call waits for a busy pool before failing with ``busy``.
    """

    def __init__(self, *, device: str = "auto", budget: int | None = None, max_replicas: int | None = None,
                 wait_s: float = 60.0, h2d_gbps: float = 25.0) -> None:
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        cuda = torch.cuda.is_available() and device != "cpu"
        if device == "cuda" and not cuda:
            raise ServiceError("bad_request", "device='cuda' asked for but torch sees no CUDA device; use 'cpu'")
        self.cuda = cuda
        gpus = budget if budget is not None else (torch.cuda.device_count() if cuda else 2)
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"budget must be a positive integer number of chunks, got {gpus!r}")
        if cuda and gpus > torch.cuda.device_count():
            raise ValueError(f"budget {gpus} exceeds the {torch.cuda.device_count()} visible CUDA devices")
        self.budget = gpus
        self._nodes = [8] * (gpus // 8) + ([gpus % 8] if gpus % 8 else [])
        self._max_replicas = max_replicas
        self._h2d_gbps = h2d_gbps
        self.wait_s = wait_s
        self._services: dict[str, _Service] = {}
        self._placement = ServicePlacement(MultiLevelCellAllocator(self._nodes), [], h2d_gbps=h2d_gbps,
                                           max_replicas=max_replicas)
        self._replicas: dict[int, _Replica] = {}
        self._routed: dict[tuple[tuple[int, tuple[int, ...]], str], _Replica] = {}  # broker-placed: (cell, service)
        self._routed_busy: set[tuple[int, tuple[int, ...]]] = set()
        self._cond = threading.Condition()
        self._clock = itertools.count(1)  # logical LRU clock: strictly increasing, no ties
        self.events: list[tuple[str, str]] = []  # ("restore" | "evict", service), in order

    # ------------------------------------------------------------------ registration
    def register_model(self, name: str, model: torch.nn.Module, tokenizer: Any, *, gpus: int = 1,
                       max_tokens: int = 512) -> None:
        """Register ``model`` (a causal LM; its weights become the host copy and the module itself is
        turned into the meta skeleton, so pass a model you no longer need) under ``name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"service name must be a non-empty string, got {name!r}")
        model.eval()
        slots = _tensor_slots(model)
        host: dict[str, torch.Tensor] = {}
        for key, where in slots.items():
            t = getattr(where[0][0], where[0][1])[where[0][2]].detach().to("cpu", copy=True).contiguous()
            host[key] = t.pin_memory() if self.cuda else t
            _assign(where, torch.empty_like(t, device="meta"))
        size_gb = sum(t.numel() * t.element_size() for t in host.values()) / 1e9
        spec = ServiceSpec(name, gpus, size_gb)
        with self._cond:
            if name in self._services:
                raise ValueError(f"service {name!r} is already registered")
            if self._placement.replicas():
                raise RuntimeError(f"register service {name!r} before the first call (replicas are resident)")
            self._services[name] = _Service(spec, host, model, tokenizer, max_tokens)
            specs = [s.spec for s in self._services.values()]
            self._placement = ServicePlacement(MultiLevelCellAllocator(self._nodes), specs,
                                               h2d_gbps=self._h2d_gbps, max_replicas=self._max_replicas)
        log.info("service_registered", service=name, gpus=gpus, checkpoint_gb=round(size_gb, 6), tensors=len(host))

    def register_pretrained(self, name: str, path: str | os.PathLike[str], *, gpus: int = 1,
                            max_tokens: int = 512) -> None:
        """Load a Hugging Face causal LM directory (offline) onto the CPU and register it."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        self.register_model(name, model, tok, gpus=gpus, max_tokens=max_tokens)

    # ------------------------------------------------------------------ introspection
    def services(self) -> list[str]:
        with self._cond:
            return sorted(self._services)

    def resident(self) -> dict[str, int]:
        """Resident replicas per service (busy or idle)."""
        with self._cond:
            out = self._placement.resident()
            for r in self._routed.values():
                if r.resident:
                    out[r.service] = out.get(r.service, 0) + 1
            return out

    def stats(self) -> dict[str, float]:
        with self._cond:
            s = self._placement.stats
            return {"hits": s.hits, "restores": s.restores, "evictions": s.evictions}

    def storage_devices(self, service: str) -> set[str]:
        """Device types of every tensor of the replicas of ``service`` (empty when it has none resident)."""
        with self._cond:
            devs: set[str] = set()
            for r in [*self._replicas.values(), *self._routed.values()]:
                if r.service == service:
                    devs |= {t.device.type for t in itertools.chain(r.model.parameters(), r.model.buffers())}
            return devs

    # ------------------------------------------------------------------ calls
    def score(self, service: str, text: str) -> dict[str, Any]:
        """Score ``text`` with ``service`` (see the module docstring); restores/evicts as needed."""
        svc, ids = self._tokens(service, text)
        rid, rep, restored, evicted = self._acquire(service)
        try:
            if restored:
                self._restore(rep, svc)
            score = self._forward(rep, ids)
        except BaseException:
            with self._cond:  # a half-restored replica must not be reused: drop it
                if restored:
                    self._evict_tensors(rep)
            self._release(rid)
            raise
        self._release(rid)
        return {"service": service, "score": score, "tokens": int(ids.shape[-1]), "restored": restored,
                "evicted": list(evicted), "device": str(rep.device)}

    def _tokens(self, service: str, text: str) -> tuple[_Service, torch.Tensor]:
        if not isinstance(text, str):
            raise ServiceError("bad_request", f"text must be a string, got {type(text).__name__}")
        with self._cond:
            svc = self._services.get(service) if isinstance(service, str) else None
            if svc is None:
                raise UnknownService(service, self._services)
        ids = svc.tokenizer(text, return_tensors="pt", truncation=True, max_length=svc.max_tokens)["input_ids"]
        if ids.shape[-1] < 2:
            raise ServiceError("bad_request", f"text must tokenize to at least 2 tokens to be scored, got {ids.shape[-1]}")
        return svc, ids

    @staticmethod
    def _forward(rep: _Replica, ids: torch.Tensor) -> float:
        with torch.inference_mode():
            x = ids.to(rep.device)
            logits = rep.model(input_ids=x).logits.float()
            lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, x[:, 1:, None]).squeeze(-1)
            return float(lp.mean().item())

    def score_at(self, route: ServiceRoute, text: str) -> dict[str, Any]:
        """Score ``text`` with ``route.service`` on the replica the broker placed (module docstring)."""
        svc, ids = self._tokens(route.service, text)
        key = self._cell_key(route.cell)
        deadline = time.monotonic() + self.wait_s
        cells = [key, *(self._cell_key(c) for c in route.evict)]
        with self._cond:
            while any(_overlap(b, c) for b in self._routed_busy for c in cells):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServiceError("busy", f"a replica on cell {key} stayed busy for {self.wait_s} s")
                self._cond.wait(left)
            if self._replicas and not self._routed:  # placed locally before the broker took over: free them
                self.evict_all()
            evicted: list[str] = []
            victims = [(self._cell_key(c), c.service) for c in route.evict]
            if not route.shared:  # exclusive cells: whatever else sits on the target cell goes too
                victims.append((key, None))
            for (k, service), r in list(self._routed.items()):
                if (k, service) == (key, route.service):
                    continue
                if any(_overlap(k, v) and v_service in (None, service) for v, v_service in victims):
                    del self._routed[(k, service)]
                    if r.resident:
                        self._evict_tensors(r)
                        evicted.append(r.service)
                        self.events.append(("evict", r.service))
            rep = self._routed.get((key, route.service))
            if rep is None:
                model = copy.deepcopy(svc.skeleton)
                rep = self._routed[(key, route.service)] = _Replica(route.service, model, _tensor_slots(model),
                                                                    self._device(Allocation(key[0], key[1])))
            restored = not rep.resident
            if restored:
                self.events.append(("restore", route.service))
            self._routed_busy.add(key)
        try:
            if restored:
                self._restore(rep, svc)
            score = self._forward(rep, ids)
        except BaseException:
            with self._cond:
                if restored:
                    self._evict_tensors(rep)
            raise
        finally:
            with self._cond:
                self._routed_busy.discard(key)
                self._cond.notify_all()
        return {"service": route.service, "score": score, "tokens": int(ids.shape[-1]), "restored": restored,
                "evicted": evicted, "device": str(rep.device), "cell": {"node": key[0], "gpus": list(key[1])},
                "replica": route.replica}

    def _cell_key(self, cell: Cell) -> tuple[int, tuple[int, ...]]:
        gpus = tuple(cell.gpus)
        if not gpus or any(cell.node * 8 + g >= self.budget or g >= 8 for g in gpus):
            raise ServiceError("bad_request", f"cell node {cell.node} GPUs {list(gpus)} is outside this actor's "
                                              f"{self.budget} GPU(s)")
        return cell.node, gpus

    def _acquire(self, service: str) -> tuple[int, _Replica, bool, tuple[str, ...]]:
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while True:
                before = set(self._placement.replicas())
                p = self._placement.acquire(service, float(next(self._clock)))
                if p is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServiceError("busy", f"every device chunk stayed busy for {self.wait_s} s; "
                                               f"raise the budget or wait_s, or send fewer concurrent calls")
                self._cond.wait(left)
            for gone in before - set(self._placement.replicas()):
                rep = self._replicas.pop(gone)
                self._evict_tensors(rep)
                self.events.append(("evict", rep.service))
                log.info("service_evicted", service=rep.service, replica=gone)
            if p.instance not in self._replicas:
                svc = self._services[service]
                model = copy.deepcopy(svc.skeleton)
                self._replicas[p.instance] = _Replica(service, model, _tensor_slots(model), self._device(p.alloc))
            rep = self._replicas[p.instance]
            restored = not rep.resident
            if restored:
                self.events.append(("restore", service))
            return p.instance, rep, restored, p.evicted

    def _release(self, rid: int) -> None:
        with self._cond:
            self._placement.release(rid, float(next(self._clock)))
            self._cond.notify_all()

    def _device(self, alloc: Allocation) -> torch.device:
        return torch.device("cuda", alloc.node * 8 + alloc.gpus[0]) if self.cuda else torch.device("cpu")

    def _restore(self, rep: _Replica, svc: _Service) -> None:
        t0 = time.perf_counter()
        for key, where in rep.slots.items():
            _assign(where, svc.host[key].to(rep.device, copy=True, non_blocking=self.cuda))
        if self.cuda:
            torch.cuda.synchronize(rep.device)
        rep.resident = True
        log.info("service_restored", service=rep.service, device=str(rep.device),
                 ms=round((time.perf_counter() - t0) * 1e3, 3))

    @staticmethod
    def _evict_tensors(rep: _Replica) -> None:
        for where in rep.slots.values():
            t = getattr(where[0][0], where[0][1])[where[0][2]]
            _assign(where, torch.empty_like(t, device="meta"))
        rep.resident = False

    def evict_all(self) -> int:
        """Evict every idle replica; returns how many."""
        with self._cond:
            before = set(self._placement.replicas())
            n = self._placement.evict_idle()
            for gone in before - set(self._placement.replicas()):
                rep = self._replicas.pop(gone)
                self._evict_tensors(rep)
                self.events.append(("evict", rep.service))
            return n


# ---------------------------------------------------------------------- actor tool
def _overlap(a: tuple[int, tuple[int, ...]], b: tuple[int, tuple[int, ...]]) -> bool:
    return a[0] == b[0] and not set(a[1]).isdisjoint(b[1])


def default_manager(budget: int | None = None) -> ServiceManager:
    """The bundled tiny model as ``tiny_reward`` plus ``LIBRA_REWARD_MODELS`` (``name=path;...``), over
    ``budget`` GPUs (on CPU: simulated one-GPU chunks; default: all visible GPUs, or 2 on CPU)."""
    from libra.engines.tiny_model import ensure_tiny_model

    mgr = ServiceManager(budget=budget)
    mgr.register_pretrained("tiny_reward", ensure_tiny_model())
    for item in filter(None, (s.strip() for s in os.environ.get("LIBRA_REWARD_MODELS", "").split(";"))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"LIBRA_REWARD_MODELS entries must be name=path, got {item!r}")
        mgr.register_pretrained(name.strip(), path.strip())
    return mgr


def service_tools(manager: ServiceManager | Callable[[], ServiceManager] | None = None) -> dict[str, Any]:
    """Work handlers ``{"reward_model": fn(args, ctx)}`` for an actor (``libra.actors.tools`` contract).

    ``manager``: a :class:`ServiceManager`, a factory called on the first call, or ``None`` for
    :func:`default_manager`. Errors become ``ToolError(code, message)`` (``unknown_service``,
    ``bad_request``, ``busy``)."""
    from libra.engines.work_context import ToolError

    box: dict[str, ServiceManager] = {}
    make: Callable[[], ServiceManager] = default_manager
    if isinstance(manager, ServiceManager):
        box["m"] = manager
    elif manager is not None:
        make = manager
    lock = threading.Lock()

    def reward_model(args: Any, ctx: Any) -> Any:
        if not isinstance(args, Mapping) or set(args) - {"service", "text"} or "service" not in args or "text" not in args:
            raise ToolError("bad_request", "reward_model needs args {'service': <name>, 'text': <str>} and nothing else")
        with lock:
            if "m" not in box:
                box["m"] = make()
        placed = (getattr(ctx, "route", None) or {}).get("service")
        try:
            if placed is not None:
                try:
                    route = ServiceRoute.from_wire(placed)
                except ValueError as exc:
                    raise ToolError("bad_request", str(exc)) from None
                if route.service != args["service"]:
                    raise ToolError("bad_request", f"route names service {route.service!r}, args {args['service']!r}")
                return box["m"].score_at(route, args["text"])
            return box["m"].score(args["service"], args["text"])
        except ServiceError as exc:
            raise ToolError(exc.code, exc.message) from exc

    return {"reward_model": reward_model}
