"""ServiceManager driven by the broker's placement (``score_at``): the replica on the routed cell is used as it
is or restored, the cells the route lists are evicted first, a bad cell or route is a typed error, and the
``reward_model`` tool obeys ``ctx.route`` (real tiny transformers models on CPU)."""

from __future__ import annotations

import pytest

from libra.actors.tools import ToolError, WorkContext
from libra.engines.services import ServiceError, ServiceManager, service_tools
from libra.engines.tiny_model import TinyModelSpec, ensure_tiny_model
from libra.protocol.payloads_actions import Cell, ServiceRoute

TEXT = "What is 12 + 30? The answer is 42."


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    return {name: str(ensure_tiny_model(spec=TinyModelSpec(seed=seed))) for name, seed in (("a", 0), ("b", 1))}


@pytest.fixture
def mgr(paths: dict[str, str]) -> ServiceManager:
    m = ServiceManager(device="cpu", budget=2)
    for name, path in paths.items():
        m.register_pretrained(name, path)
    return m


def route(service: str, gpu: int, restore: bool, evict: tuple[int, ...] = (), replica: int = 0) -> ServiceRoute:
    return ServiceRoute(service=service, replica=replica, cell=Cell(node=0, gpus=[gpu]), restore=restore,
                        evict=[Cell(node=0, gpus=[g]) for g in evict])


def test_routed_calls_restore_once_then_hit_and_evict_what_the_route_lists(mgr: ServiceManager) -> None:
    first = mgr.score_at(route("a", 0, True), TEXT)
    assert first["restored"] is True and first["cell"] == {"node": 0, "gpus": [0]} and first["evicted"] == []
    hit = mgr.score_at(route("a", 0, False), TEXT)
    assert hit["restored"] is False and hit["score"] == first["score"]
    mgr.score_at(route("b", 1, True, replica=1), TEXT)
    assert mgr.resident() == {"a": 1, "b": 1}
    # the broker evicts a's idle replica (LRU) to place b's second replica on cell 0
    moved = mgr.score_at(route("b", 0, True, evict=(0,), replica=2), TEXT)
    assert moved["restored"] is True and moved["evicted"] == ["a"] and mgr.resident() == {"b": 2}
    assert mgr.events == [("restore", "a"), ("restore", "b"), ("evict", "a"), ("restore", "b")]
    assert mgr.storage_devices("a") == set()  # a's weights are gone from the device: meta tensors only


def test_a_route_outside_the_actors_gpus_is_a_typed_error(mgr: ServiceManager) -> None:
    with pytest.raises(ServiceError) as ei:
        mgr.score_at(route("a", 5, True), TEXT)
    assert ei.value.code == "bad_request" and "outside" in str(ei.value)


def test_reward_model_tool_follows_the_route_in_its_context(mgr: ServiceManager) -> None:
    fn = service_tools(mgr)["reward_model"]
    ctx = WorkContext("w1", "t1", 10.0, route={"service": route("a", 1, True, replica=7).to_wire()})
    out = fn({"service": "a", "text": TEXT}, ctx)
    assert out["cell"] == {"node": 0, "gpus": [1]} and out["replica"] == 7 and out["restored"] is True
    with pytest.raises(ToolError) as ei:  # the route must name the service the args ask for
        fn({"service": "b", "text": TEXT}, ctx)
    assert ei.value.code == "bad_request"
    bad = WorkContext("w2", "t1", 10.0, route={"service": {"service": "a"}})
    with pytest.raises(ToolError) as ei:
        fn({"service": "a", "text": TEXT}, bad)
    assert ei.value.code == "bad_request" and "service route" in ei.value.message


def test_shared_cells_keep_co_resident_replicas_and_evict_only_the_listed_one(mgr: ServiceManager) -> None:
    def shared(service: str, evict: list[Cell]) -> ServiceRoute:
        return ServiceRoute(service=service, replica=0, cell=Cell(node=0, gpus=[0]), restore=True, evict=evict,
                            shared=True)

    mgr.score_at(shared("a", []), TEXT)
    out = mgr.score_at(shared("b", []), TEXT)
    assert out["evicted"] == [] and mgr.resident() == {"a": 1, "b": 1}  # both on GPU 0
    hit = mgr.score_at(shared("a", []), TEXT)
    assert hit["restored"] is False
    back = mgr.score_at(shared("a", [Cell(node=0, gpus=[0], service="b")]), TEXT)
    assert back["evicted"] == ["b"] and mgr.resident() == {"a": 1}
