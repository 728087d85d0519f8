"""``python -m libra.actors --broker URL [--cpu-slots N] [--gpu-slots auto|N]``: run this host's actors."""

from __future__ import annotations

import argparse
import signal
import socket
import sys

from libra.logging import configure, get_logger

from .slots import resolve_slots
from .supervisor import Supervisor


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m libra.actors",
        description="Start and supervise one Libra actor process per GPU and CPU slot on this host.",
    )
    p.add_argument("--broker", required=True, help="broker endpoint, e.g. tcp://10.0.0.1:5555")
    p.add_argument("--cpu-slots", type=int, default=None,
                   help="number of CPU slots (default: cores - 1, at least 1)")
    p.add_argument("--gpu-slots", default="auto",
                   help="'auto' (count GPUs with NVML; none without a driver) or a number (default: auto)")
    p.add_argument("--capacity", type=int, default=4, help="concurrent work items per slot (default %(default)s)")
    p.add_argument("--no-restart", action="store_true", help="do not restart slots that exit")
    p.add_argument("--no-sandbox", action="store_true", help="CPU slots offer only echo/sleep")
    p.add_argument("--allow-unisolated", action="store_true",
                   help="run code tools without bubblewrap (NOT safe for untrusted code)")
    p.add_argument("--roles", default=None,
                   help="roles per CPU slot, e.g. 'rollout=2,train=2,action=1,episode=1' (slots in that order; "
                        "sets --cpu-slots to the total). Default: every slot is an action slot")
    p.add_argument("--model-dir", default=None, help="transformers checkpoint for rollout/train slots")
    p.add_argument("--run-dir", default=None, help="job run directory shared by rollout/train slots")
    p.add_argument("--torch-threads", type=int, default=0, help="torch CPU threads per engine slot (0: default)")
    p.add_argument("--rollout-batch", type=int, default=32, help="max turns a rollout slot decodes together")
    p.add_argument("--episode-concurrency", type=int, default=64, help="episodes an episode slot runs at once")
    p.add_argument("--actor-id-prefix", default="",
                   help="actor ids become HOST/PREFIX-SLOT (default HOST/SLOT); needed to run a second "
                        "supervisor on one host against the same broker")
    p.add_argument("--log-level", default=None)
    return p


ROLES = ("action", "rollout", "train", "hybrid", "episode")


def parse_roles(spec: str) -> list[str]:
    """``'rollout=2,train=1'`` → ``['rollout', 'rollout', 'train']``; raises ValueError with the reason."""
    out: list[str] = []
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, _, count = part.partition("=")
        if name not in ROLES:
            raise ValueError(f"--roles: unknown role {name!r} (known: {', '.join(ROLES)})")
        try:
            n = int(count or "1")
        except ValueError:
            raise ValueError(f"--roles: count for {name!r} must be an integer, got {count!r}") from None
        if n < 0:
            raise ValueError(f"--roles: count for {name!r} must be >= 0")
        out += [name] * n
    if not out:
        raise ValueError("--roles names no slots")
    return out


def slot_arguments(slots: list[str], roles: list[str] | None, prefix: str, host: str) -> dict[str, list[str]]:
    """Per-slot runtime arguments: ``--actor-id HOST/PREFIX-SLOT`` with a prefix, ``--role`` per CPU slot."""
    out: dict[str, list[str]] = {s: [] for s in slots}
    if prefix:
        if "/" in prefix or not prefix.strip():
            raise ValueError(f"--actor-id-prefix must be a non-empty name without '/', got {prefix!r}")
        for s in slots:
            out[s] += ["--actor-id", f"{host}/{prefix}-{s}"]
    if roles is not None:
        cpu = [s for s in slots if s.startswith("cpu")]
        for s, r in zip(cpu, roles):
            out[s] += ["--role", r]
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level, cache=True)
    log = get_logger("libra.actors")
    try:
        roles = parse_roles(args.roles) if args.roles else None
        if roles is not None:
            args.cpu_slots = len(roles)
        slots, gpu_reason = resolve_slots(args.cpu_slots, args.gpu_slots)
    except ValueError as exc:
        print(f"libra.actors: {exc}", file=sys.stderr)
        return 2
    n_gpu = sum(s.startswith("gpu") for s in slots)
    if n_gpu == 0:
        log.warning("no_gpu_slots", reason=gpu_reason, cpu_slots=len(slots))
    else:
        log.info("gpu_slots", count=n_gpu, reason=gpu_reason)
    if not slots:
        print("libra.actors: no slots to start (--cpu-slots 0 and no GPUs)", file=sys.stderr)
        return 2
    extra = []
    if args.no_sandbox:
        extra.append("--no-sandbox")
    if args.allow_unisolated:
        extra.append("--allow-unisolated")
    if args.log_level:
        extra += ["--log-level", args.log_level]
    for flag, value in (("--model-dir", args.model_dir), ("--run-dir", args.run_dir)):
        if value:
            extra += [flag, value]
    extra += ["--torch-threads", str(args.torch_threads), "--rollout-batch", str(args.rollout_batch),
              "--episode-concurrency", str(args.episode_concurrency)]
    try:
        slot_args = slot_arguments(slots, roles, args.actor_id_prefix, socket.gethostname())
    except ValueError as exc:
        print(f"libra.actors: {exc}", file=sys.stderr)
        return 2
    sup = Supervisor(args.broker, slots, capacity=args.capacity, restart=not args.no_restart, extra_args=extra,
                     slot_args=slot_args)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stop())
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
