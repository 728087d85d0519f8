"""What one actor slot runs, from its command line: the handlers of its role, the kinds it bids for, its
capabilities and capacity, its engine's reconfiguration (hybrid and lent slots) and, for a lent slot, its
owner. Used by ``python -m libra.actors.runtime`` (:func:`libra.actors.runtime.main`).

A lent slot (``--lend SPEC``, ``libra.actors.owners``) is a hybrid slot restricted to ``generate``: it builds
its rollout engine at start-up, can release it when its owner reclaims the GPU and rebuild it when lent again
(``HybridRole.reconfigure``), and never offers ``train`` (a borrowed GPU never holds training state). Its
hello says ``labels["lend"] = {"owner", "rule"}``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from libra.logging import get_logger

from .tools import ToolLoadError, action_slot_tools, handlers_for_tools
from .topology import action_labels

__all__ = ["SlotRole", "SlotSetupError", "slot_role"]

log = get_logger("libra.actor")


class SlotSetupError(ValueError):
    """The slot cannot start as asked (the message says why)."""


@dataclass
class SlotRole:
    kinds: list[str]
    caps: dict[str, list[str]]
    capacity: int
    handlers: dict[tuple[str, str], Any]
    tools: dict[str, Any] = field(default_factory=dict)
    reconfigure: Any = None
    owner: Any = None  # a lent slot's owner plug-in


def slot_role(args: argparse.Namespace, labels: dict[str, Any]) -> SlotRole:
    """The slot's role from ``args`` (``labels`` gains what the broker should know). Raises
    :class:`SlotSetupError`."""
    if getattr(args, "lend", None):
        return _lent(args, labels)
    if args.role == "action":
        return _action(args, labels)
    if args.role == "hybrid":
        from .roles import HybridRole

        if args.model_dir is None:
            raise SlotSetupError("role 'hybrid' needs --model-dir")
        hybrid = HybridRole(args.model_dir, args.run_dir, args.slot, max_batch=args.rollout_batch,
                            torch_threads=args.torch_threads, eager=True, actor_id=getattr(args, "actor_id", None))
        return SlotRole(["generate"], {"generate": ["default"], "train": ["grpo"]}, args.rollout_batch,
                        {("generate", "*"): hybrid.generate, ("train", "grpo"): hybrid.train},
                        reconfigure=hybrid.reconfigure)
    if args.role == "episode":
        from .episode_role import EpisodeRole

        runner = EpisodeRole(args.broker, args.model_dir, args.slot)
        return SlotRole(["episode"], {"episode": ["*"]}, max(1, args.episode_concurrency),
                        {("episode", "*"): runner.episode})
    from .roles import role_handlers

    try:
        kinds, caps, handlers = role_handlers(args.role, args.model_dir, args.run_dir, args.slot,
                                              max_batch=args.rollout_batch, torch_threads=args.torch_threads,
                                              actor_id=getattr(args, "actor_id", None))
    except (ValueError, FileNotFoundError) as exc:
        raise SlotSetupError(str(exc)) from None
    # a trainer rank holds one step at a time; a rollout slot batches many concurrent turns
    capacity = 1 if args.role == "train" else max(args.capacity, args.rollout_batch)
    return SlotRole(kinds, caps, capacity, handlers)


def _action(args: argparse.Namespace, labels: dict[str, Any]) -> SlotRole:
    try:
        labels.update(action_labels(args.slot, args.service_gpus))  # cores, NUMA nodes, service GPUs
    except ValueError as exc:
        raise SlotSetupError(str(exc)) from None
    if labels["gpu_emulated"]:
        log.warning("gpu_slot_emulated_on_cpu", slot=args.slot, gpus=labels["gpus"],
                    reason="no GPU found: model services run on CPU in simulated one-GPU chunks")
    from libra.protocol.payloads_actions import TOOL_DECLS_LABEL

    try:  # the built-ins plus the user's tools (--tools, the libra.tools entry points), declared in the labels
        tools, decls = action_slot_tools(args.tools, enable_sandbox=not args.no_sandbox,
                                         service_gpus=labels["gpus"], allow_unisolated=args.allow_unisolated,
                                         host_cores=labels["cores"])
    except ToolLoadError as exc:
        raise SlotSetupError(str(exc)) from None
    labels.update({TOOL_DECLS_LABEL: decls} if decls else {})
    return SlotRole(["action"], {"action": sorted(tools)}, args.capacity, handlers_for_tools(tools), tools)


def _lent(args: argparse.Namespace, labels: dict[str, Any]) -> SlotRole:
    from .owners import LendSpecError, OwnerError, owner_from_spec, parse_lend_spec
    from .roles import HybridRole

    if args.role not in ("rollout", "hybrid"):
        raise SlotSetupError(f"--lend: a lent slot serves rollouts only (role rollout or hybrid), not {args.role!r}: "
                             "a borrowed GPU never holds training state")
    if args.model_dir is None:
        raise SlotSetupError("--lend needs --model-dir (a lent slot runs a rollout engine)")
    try:
        spec = parse_lend_spec(args.lend)
        owner = owner_from_spec(spec)
    except (LendSpecError, OwnerError) as exc:
        raise SlotSetupError(str(exc)) from None
    labels["lend"] = spec.label()
    labels["engine_role"] = "rollout"  # never a hybrid for the pool: it has no train capability
    hybrid = HybridRole(args.model_dir, args.run_dir, args.slot, max_batch=args.rollout_batch,
                        torch_threads=args.torch_threads, eager=True, actor_id=getattr(args, "actor_id", None))
    return SlotRole(["generate"], {"generate": ["default"]}, args.rollout_batch, {("generate", "*"): hybrid.generate},
                    reconfigure=hybrid.reconfigure, owner=owner)
