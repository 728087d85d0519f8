"""DataPlaneServer's provider: objects made on demand when a fetcher asks (how a rollout instance serves a
trajectory's context only when another instance needs it)."""

from __future__ import annotations

import pytest

from libra.dataplane import DataPlaneServer, ObjectNotFound, ObjectRef, fetch


def test_the_provider_makes_objects_on_demand_and_is_asked_again_each_time() -> None:
    asked: list[str] = []
    version = {"n": 0}

    def provide(name: str):
        asked.append(name)
        if name == "boom":
            raise KeyError("nothing held for boom")
        if not name.startswith("made/"):
            return None
        version["n"] += 1
        return b"h%d" % version["n"], [b"abc", b"de"]

    with DataPlaneServer(provider=provide) as server:
        server.publish("plain", b"hp", [b"xyz"])
        header, chunks, stats = fetch(ObjectRef(server.endpoint, "made/a"))
        assert header == b"h1" and [bytes(c) for c in chunks] == [b"abc", b"de"] and stats.nbytes == 5
        header, _, _ = fetch(ObjectRef(server.endpoint, "made/a"))
        assert header == b"h2"  # made afresh: the provider's object reflects its current state
        assert fetch(ObjectRef(server.endpoint, "plain"))[0] == b"hp"  # None: the published objects answer
        with pytest.raises(ObjectNotFound, match="nothing held for boom"):
            fetch(ObjectRef(server.endpoint, "boom"))
        assert asked == ["made/a", "made/a", "plain", "boom"]
        for i in range(DataPlaneServer.PROVIDED_KEEP + 2):
            fetch(ObjectRef(server.endpoint, f"made/{i}"))
        made = [n for n in server.names() if n.startswith("made/")]
        assert len(made) == DataPlaneServer.PROVIDED_KEEP  # made objects do not pile up
