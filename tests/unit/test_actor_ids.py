"""Actor ids: a prefix gives a second supervisor on one host ids of its own; every slot names its supervisor run."""

from __future__ import annotations

import pytest

from libra.actors.__main__ import slot_arguments
from libra.actors.supervisor import Supervisor


def test_prefix_gives_each_slot_its_own_id() -> None:
    args = slot_arguments(["cpu0", "cpu1"], ["rollout", "train"], "b", "host1")
    assert args == {"cpu0": ["--actor-id", "host1/b-cpu0", "--role", "rollout"],
                    "cpu1": ["--actor-id", "host1/b-cpu1", "--role", "train"]}
    assert slot_arguments(["cpu0"], None, "", "host1") == {"cpu0": []}  # default: HOST/SLOT, set by the slot


@pytest.mark.parametrize("bad", ["a/b", " "])
def test_bad_prefix_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="--actor-id-prefix"):
        slot_arguments(["cpu0"], None, bad, "h")


def test_every_slot_of_one_supervisor_carries_its_instance() -> None:
    a = Supervisor("tcp://127.0.0.1:1", ["cpu0", "cpu1"])
    b = Supervisor("tcp://127.0.0.1:1", ["cpu0"])
    for sup in (a, b):
        for c in sup.children:
            i = c.argv.index("--instance")
            assert c.argv[i + 1] == sup.instance
    assert a.instance != b.instance
