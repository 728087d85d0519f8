"""The saved form of C-MLFQ's causal prefix tree: the versioned JSON format, a frozen snapshot of a tree's
state, and the atomic file write.

A :class:`TreeState` is what a snapshot reads from a
:class:`~libra.policies.routing.prefix_tree.CausalPrefixTree`: its parameters, the global tree, the prompt
trees and rebuild history (copied lists) and the last rebuild step. :func:`dump_state` turns it into the
JSON-ready dict, :func:`iter_state_json` into the same JSON text in pieces without building the dicts, and
:func:`check_header` / :func:`parse_body` read a saved dict back (the tree itself is assembled by
``CausalPrefixTree.from_dict``). :class:`Snapshot` wraps a state taken at ``freeze``.
No I/O except :func:`write_atomic`; no clocks, no threads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from libra.policies.routing.prefix_tree_nodes import FinishedTrajectory, PrefixTree, PrefixTreeError, check_int

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PARAM_NAMES",
    "Snapshot",
    "TreeState",
    "check_header",
    "dump_state",
    "iter_state_json",
    "parse_body",
    "write_atomic",
]

FORMAT_NAME: Final = "libra-cmlfq-prefix-tree"
FORMAT_VERSION: Final = 1
PARAM_NAMES: Final = ("window_size", "max_prompts", "history_size", "rebuild_interval")


@dataclass(frozen=True, slots=True)
class TreeState:
    """What a snapshot of a causal prefix tree reads: parameters, trees, history and the last rebuild step."""

    params: dict[str, int]
    global_tree: PrefixTree
    prompts: list[tuple[str, PrefixTree]]
    history: list[FinishedTrajectory]
    last_rebuild_step: int


def _record(t: FinishedTrajectory) -> dict[str, Any]:
    return {"prompt_id": t.prompt_id, "states": list(t.states), "positions": list(t.positions),
            "total": t.total_output_tokens}


def dump_state(state: TreeState) -> dict[str, Any]:
    """The JSON-ready, versioned dict of ``state`` (trees, parameters and rebuild history)."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "params": dict(state.params),
        "last_rebuild_step": state.last_rebuild_step,
        "global": state.global_tree.to_dict(),
        "prompts": {pid: tree.to_dict() for pid, tree in state.prompts},
        "history": [_record(t) for t in state.history],
    }


def iter_state_json(state: TreeState) -> Iterator[str]:
    """``json.dumps(dump_state(state), separators=(",", ":"))`` in pieces."""
    dumps = json.dumps
    yield (f'{{"format":{dumps(FORMAT_NAME)},"version":{FORMAT_VERSION},'
           f'"params":{dumps(state.params, separators=(",", ":"))},'
           f'"last_rebuild_step":{state.last_rebuild_step},"global":')
    yield from state.global_tree.iter_json()
    yield ',"prompts":{'
    for i, (pid, tree) in enumerate(state.prompts):
        yield ("," if i else "") + dumps(pid) + ":"
        yield from tree.iter_json()
    yield '},"history":['
    for i, t in enumerate(state.history):
        yield ("," if i else "") + dumps(_record(t), separators=(",", ":"))
    yield "]}"


def check_header(data: Any) -> dict[str, Any]:
    """Check a saved dict's format and version; returns its known parameters.

    Raises :class:`PrefixTreeError` naming the field for a wrong format, an unsupported version or bad params.
    """
    if not isinstance(data, Mapping):
        raise PrefixTreeError(f"prefix tree file must hold a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT_NAME:
        raise PrefixTreeError(f"not a prefix tree file: format={data.get('format')!r}, expected {FORMAT_NAME!r}")
    if data.get("version") != FORMAT_VERSION:
        raise PrefixTreeError(
            f"unsupported prefix tree version {data.get('version')!r} (this build reads {FORMAT_VERSION})"
        )
    params = data.get("params", {})
    if not isinstance(params, Mapping):
        raise PrefixTreeError("params must be an object")
    return {k: v for k, v in params.items() if k in PARAM_NAMES}


def parse_body(data: Mapping[str, Any], window_size: int) -> TreeState:
    """The trees, history and last rebuild step of a saved dict whose header :func:`check_header` accepted
    (``params`` of the result is empty: the caller has them). Raises :class:`PrefixTreeError` naming the bad field.
    """
    last_rebuild = check_int("last_rebuild_step", data.get("last_rebuild_step", 0))
    if "global" not in data:
        raise PrefixTreeError("missing field 'global'")
    glob = PrefixTree.from_dict(data["global"], window_size, "global")
    prompts = data.get("prompts", {})
    if not isinstance(prompts, Mapping):
        raise PrefixTreeError("prompts must be an object")
    trees = [(pid, PrefixTree.from_dict(tdata, window_size, f"prompts[{pid!r}]")) for pid, tdata in prompts.items()]
    history = data.get("history", [])
    if not isinstance(history, list):
        raise PrefixTreeError("history must be a list")
    records = []
    for i, rec in enumerate(history):
        try:
            records.append(
                FinishedTrajectory(rec["prompt_id"], tuple(rec["states"]), tuple(rec["positions"]), rec["total"])
            )
        except (KeyError, TypeError) as exc:
            raise PrefixTreeError(f"history[{i}]: bad record ({exc!r})") from None
        except PrefixTreeError as exc:
            raise PrefixTreeError(f"history[{i}]: {exc}") from None
    return TreeState({}, glob, trees, records, last_rebuild)


def write_atomic(path: str | os.PathLike[str], chunks: Iterable[str]) -> int:
    """Write the text ``chunks`` to ``PATH.tmp``, fsync it and rename it over ``path``; returns the bytes
    written. A reader sees the old file or the new one, never a partial one. Raises ``OSError``."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(chunks)
        fh.flush()
        os.fsync(fh.fileno())
        size = fh.tell()
    os.replace(tmp, target)
    return size


class Snapshot:
    """The state of a :class:`~libra.policies.routing.prefix_tree.CausalPrefixTree` at its ``freeze``;
    readable from another thread until the owner calls ``thaw``."""

    __slots__ = ("_state",)

    def __init__(self, state: TreeState) -> None:
        self._state = state

    def to_dict(self) -> dict[str, Any]:
        """What ``CausalPrefixTree.to_dict`` returned at the freeze."""
        return dump_state(self._state)

    def iter_json(self) -> Iterator[str]:
        """The same as compact JSON text in pieces, without building the dicts."""
        return iter_state_json(self._state)
