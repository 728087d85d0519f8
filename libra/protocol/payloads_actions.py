"""Typed payloads of action placement: what an action actor reports about its resources (in its hello
labels, :class:`ActorResources`) and where the broker's placement puts one action (``Assign.route``,
:class:`ActionRoute`, with :class:`ServiceRoute` for a GPU-service call such as ``reward_model``).

No I/O. The broker's action placement (``libra/broker/actions.py``) reads the first and writes the second;
the actor's runtime hands the route to the tool (sandbox tools pin to ``core_ids``; the GPU service engine
restores, evicts and runs on the cell the route names).

An action actor also declares the resources of each user tool it offers (``libra actors --tools pkg.mod``,
``libra/actors/tools.py``) in its hello labels: ``labels["tool_decls"] = {tool: ToolDeclaration}``
(:func:`tool_declarations` reads them back). The broker's action placement schedules such a tool by its
declaration (cores, a GPU service) when no ``BrokerConfig.tools`` entry names it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .payloads_base import Payload, PayloadError

__all__ = ["ActionRoute", "ActorResources", "Cell", "ServiceRoute", "TOOL_DECLS_LABEL", "ToolDeclaration",
           "tool_declarations"]

#: The hello label holding an action actor's user-tool declarations.
TOOL_DECLS_LABEL = "tool_decls"

Count = Annotated[int, msgspec.Meta(ge=0)]


class ActorResources(Payload, frozen=True, kw_only=True):
    """The resources an action actor offers, from its hello labels (``cores``, ``cpus``, ``numa``, ``gpus``).

    ``cpus`` are the CPU ids its sandboxes may run on and ``numa`` the NUMA node of each (same length);
    actors on one host that list the same ids share those cores, and the broker never grants one core to
    two actions at once. Without ``cpus`` the actor's ``cores`` (default: its capacity) are its own. ``gpus``
    is the number of GPUs its model services may use (0: none; a slot declared with GPU labels on a CPU-only
    host runs its services on CPU and says so in ``gpu_emulated``)."""

    WHAT = "actor resources"

    cores: Annotated[int, msgspec.Meta(ge=1)] | None = None
    cpus: list[Count] | None = None
    numa: list[Count] | None = None
    gpus: Count = 0
    gpu_emulated: bool = False

    def __post_init__(self) -> None:
        if self.cpus is not None:
            if len(set(self.cpus)) != len(self.cpus) or not self.cpus:
                raise ValueError(f"field `cpus`: must be distinct CPU ids, at least one, got {self.cpus}")
            if self.numa is not None and len(self.numa) != len(self.cpus):
                raise ValueError(f"field `numa`: one NUMA node per CPU id ({len(self.cpus)}), got {len(self.numa)}")
        elif self.numa is not None:
            raise ValueError("field `numa`: given without `cpus`")


class Cell(Payload, frozen=True, kw_only=True):
    """One aligned GPU cell of a GPU actor: ``gpus`` consecutive GPU indices on ``node`` (1, 2, 4 or 8); in an
    eviction list, ``service`` names the replica evicted there (None: every replica on it)."""

    WHAT = "GPU cell"
    OMIT_DEFAULT = ("service",)

    node: Count
    gpus: list[Count]
    service: str | None = None


class ServiceRoute(Payload, frozen=True, kw_only=True):
    """Where a GPU-service call runs on its actor: the replica ``replica`` of ``service`` on ``cell``.
    ``restore``: the broker placed a new replica there (the actor copies the weights from host memory
    first); ``evict``: the idle replicas (cell and service) the broker evicted to make room (least recently
    used), to be freed before the restore. ``shared``: the GPU memory model is on (replicas of several
    services stay resident on one cell while their memory fits; only the listed ones go); otherwise a cell
    holds one replica and any other replica on it goes too."""

    WHAT = "service route"

    service: str
    replica: Count
    cell: Cell
    restore: bool
    evict: list[Cell] = msgspec.field(default_factory=list)
    shared: bool = False


class ActionRoute(Payload, frozen=True, kw_only=True):
    """``Assign.route`` of an ``action`` placed by the broker's action scheduler: the cores granted (the
    degree of parallelism), the exact CPU ids when the actor reported its CPUs, and for a GPU-service call
    the :class:`ServiceRoute`. ``release``: trajectories that ended whose sandboxes this actor holds (the
    broker's ``sandbox_release``): the actor retires them; carried by sandbox tool calls only."""

    WHAT = "action route"
    OMIT_DEFAULT = ("core_ids", "service", "release")

    cores: Annotated[int, msgspec.Meta(ge=1)] = 1
    core_ids: list[Count] | None = None
    service: ServiceRoute | None = None
    release: list[Annotated[str, msgspec.Meta(min_length=1)]] | None = None


class ToolDeclaration(Payload, frozen=True, kw_only=True):
    """What a user tool declares about one call (``libra.actors.tools.Tool``, as sent in hello labels):
    ``cores`` granted to it (the action scheduler's demand), ``memory_mb`` it may use (None: undeclared; the
    actor checks it fits the host), ``gpu_service`` (the GPU model service its calls run on: routed like
    ``reward_model``), ``sandboxed`` and ``inline`` (see the tools module), a one-line ``description``."""

    WHAT = "tool declaration"
    OMIT_DEFAULT = ("memory_mb", "gpu_service", "description")

    cores: Annotated[int, msgspec.Meta(ge=1)] = 1
    memory_mb: Annotated[int, msgspec.Meta(ge=1)] | None = None
    gpu_service: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    sandboxed: bool = False
    inline: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.inline and (self.sandboxed or self.gpu_service or self.cores > 1):
            raise ValueError("field `inline`: an inline tool runs on the actor's socket thread, so it cannot be "
                             "sandboxed, call a GPU service or take more than one core")


def tool_declarations(labels: object) -> dict[str, ToolDeclaration]:
    """The user-tool declarations in an actor's hello ``labels`` (``{}`` when there are none); raises
    :class:`~libra.protocol.payloads_base.PayloadError` naming the tool when one does not parse."""
    table = labels.get(TOOL_DECLS_LABEL) if isinstance(labels, dict) else None
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise PayloadError("tool declaration", TOOL_DECLS_LABEL, f"expected a table, got {type(table).__name__}")
    out: dict[str, ToolDeclaration] = {}
    for name, decl in table.items():
        try:
            out[str(name)] = ToolDeclaration.from_wire(decl)
        except PayloadError as exc:
            raise PayloadError(f"tool declaration of {name!r}", exc.field, exc.detail) from None
    return out
