"""``python -m libra.actors --broker URL [--cpu-slots N] [--gpu-slots auto|N] [--tools pkg.mod ...]``: run this
host's actors. ``--tools`` modules (and the ``libra.tools`` entry points) are loaded here first, so a module
that does not import, a tool declared twice or one named like a built-in stops the command with the reason
(``libra.actors.tools``); every action slot then loads them again and offers them."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

from libra.transport.endpoints import parse_endpoints
from libra.logging import configure, get_logger

from libra.engines.device.dtypes import DTYPE_ENV, parse_dtype
from libra.engines.device.placement import ENGINES_PER_GPU_ENV, MEMORY_FRACTION_ENV
from libra.engines.device.tp_groups import NODE_GPUS_ENV

from .slots import place_gpu_roles, resolve_slots
from .supervisor import Supervisor


def build_parser(prog: str = "python -m libra.actors") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Start and supervise one Libra actor process per GPU and CPU slot on this host.",
    )
    p.add_argument("--broker", required=True,
                   help="broker endpoint, e.g. tcp://10.0.0.1:5555, or a comma-separated list of a primary and "
                        "standbys (tcp://10.0.0.1:5555,tcp://10.0.0.2:5555): each slot moves to the next address "
                        "when the broker it uses goes silent")
    p.add_argument("--cpu-slots", type=int, default=None,
                   help="number of CPU slots (default: cores - 1, at least 1)")
    p.add_argument("--gpu-slots", default="auto",
                   help="'auto' (count GPUs with NVML; none without a driver) or a number (default: auto)")
    p.add_argument("--capacity", type=int, default=4, help="concurrent work items per slot (default %(default)s)")
    p.add_argument("--no-restart", action="store_true", help="do not restart slots that exit")
    p.add_argument("--no-sandbox", action="store_true", help="CPU slots offer only echo/sleep")
    p.add_argument("--allow-unisolated", action="store_true",
                   help="run code tools without bubblewrap (NOT safe for untrusted code)")
    p.add_argument("--tools", action="append", default=[], metavar="MODULE",
                   help="action slots also offer the tools this module declares in LIBRA_TOOLS (repeatable; "
                        "see libra.actors.tools); tools of installed libra.tools entry points are always offered")
    p.add_argument("--roles", default=None,
                   help="roles per CPU slot, e.g. 'rollout=2,train=2,action=1,episode=1' (slots in that order; "
                        "sets --cpu-slots to the total). Default: every slot is an action slot")
    p.add_argument("--gpu-roles", default=None,
                   help="engine slots on this host's GPUs, e.g. 'rollout=2,train=2' (spread over the GPUs found, "
                        "gpuN then gpuN.K when several share one; with no GPU they run as CPU slots and say so). "
                        "Default: one slot per GPU (--gpu-slots), role --gpu-role")
    p.add_argument("--gpu-role", default="hybrid", choices=["hybrid", "rollout", "train", "action"],
                   help="role of the one-per-GPU slots (default %(default)s: rollout or training as the broker's "
                        "directives say; needs --model-dir, without it GPU slots are not started)")
    p.add_argument("--dtype", default="auto",
                   help="engine dtype: auto (bf16 on a GPU, fp32 on the CPU), bf16, fp16 or fp32")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.0,
                   help="share of its GPU's memory an engine may use (0: 0.9 split among the engines on that GPU)")
    p.add_argument("--model-dir", default=None, help="transformers checkpoint for rollout/train slots")
    p.add_argument("--run-dir", default=None, help="job run directory shared by rollout/train slots")
    p.add_argument("--torch-threads", type=int, default=0, help="torch CPU threads per engine slot (0: default)")
    p.add_argument("--rollout-batch", type=int, default=32, help="max turns a rollout slot decodes together")
    p.add_argument("--episode-concurrency", type=int, default=64, help="episodes an episode slot runs at once")
    p.add_argument("--actor-id-prefix", default="",
                   help="actor ids become HOST/PREFIX-SLOT (default HOST/SLOT); needed to run a second "
                        "supervisor on one host against the same broker")
    p.add_argument("--no-direct", action="store_true",
                   help="CPU slots bind no direct socket: clients' calls of inline tools always go through the broker")
    p.add_argument("--lend", default=None, metavar="SPEC",
                   help="this host's engine slots run on GPUs that belong to an owner: owner=NAME,kind=serving|"
                        "notice|schedule,... (docs/lending.md). They serve rollouts only, while the owner allows, and "
                        "hand the GPU back by the owner's deadline")
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


def slot_arguments(slots: list[str], roles: list[str] | None, prefix: str, host: str,
                   gpu_roles: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Per-slot runtime arguments: ``--actor-id HOST/PREFIX-SLOT`` with a prefix, ``--role`` per CPU slot and
    per GPU slot named in ``gpu_roles``."""
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
    for s, r in (gpu_roles or {}).items():
        if s in out:
            out[s] += ["--role", r]
    return out


def gpu_layout(gpu_roles: list[str] | None, gpu_slots: list[str], n_gpus: int, gpu_role: str,
               model_dir: str | None) -> tuple[list[str], dict[str, str], dict[str, dict[str, str]], list[str], str]:
    """Where the GPU slots go: ``(gpu slot names, role per GPU slot, environment per GPU slot, roles that fall
    back to CPU slots, a sentence saying what was decided)``. ``gpu_roles`` (``--gpu-roles``) are spread over
    ``n_gpus`` GPUs; with none found they become CPU slots. Otherwise each of ``gpu_slots`` gets ``gpu_role``;
    engine roles need ``model_dir`` (without it no GPU slot is started: GPU slots never default to actions).
    The environment per GPU slot holds the engines sharing its GPU; the GPU itself follows from the slot's
    name (``gpuN`` and ``gpuN.K`` see GPU N) when the supervisor builds its environment
    (:func:`libra.actors.slots.slot_cuda_env`)."""
    if gpu_roles is not None:
        if n_gpus < 1:
            return [], {}, {}, list(gpu_roles), (f"no GPU available: the {len(gpu_roles)} GPU engine slot(s) "
                                                 "run on the CPU")
        placed = place_gpu_roles(gpu_roles, n_gpus)
        # the GPU itself (CUDA_VISIBLE_DEVICES) follows from the slot's name: libra.actors.slots.slot_cuda_env
        env = {p.slot: {ENGINES_PER_GPU_ENV: str(p.sharing)} for p in placed}
        return ([p.slot for p in placed], {p.slot: p.role for p in placed}, env, [],
                f"{len(placed)} engine slot(s) on {min(n_gpus, len(placed))} GPU(s)")
    if gpu_slots and gpu_role != "action" and model_dir is None:
        return [], {}, {}, [], (f"{len(gpu_slots)} GPU(s) left unused: GPU slots run engines (--gpu-role "
                                f"{gpu_role}) and need --model-dir")
    return (list(gpu_slots), {s: gpu_role for s in gpu_slots},
            {s: {} for s in gpu_slots}, [], f"{len(gpu_slots)} GPU slot(s) as {gpu_role}")


def check_lend(spec: str | None, roles: list[str] | None, gpu_roles: list[str] | None, gpu_role: str) -> None:
    """A ``--lend`` host runs rollout slots only (a borrowed GPU never holds training state); raises ValueError
    (a bad spec: ``LendSpecError``) with the reason."""
    if spec is None:
        return
    from .owners import parse_lend_spec

    parse_lend_spec(spec)
    if any(r in ("train", "episode") for r in [*(gpu_roles or []), *(roles or [])]) or \
            (gpu_roles is None and gpu_role not in ("rollout", "hybrid")):
        raise ValueError("--lend: a lent host runs rollout slots only (--roles/--gpu-roles rollout=N, "
                         "--gpu-role rollout): a borrowed GPU never holds training state")


def lend_engine_slots(slot_args: dict[str, list[str]], spec: str | None) -> None:
    """Give every engine slot (rollout, hybrid) ``--lend SPEC``; action slots stay the host's own."""
    for a in slot_args.values():
        if spec and "--role" in a and a[a.index("--role") + 1] in ("rollout", "hybrid"):
            a += ["--lend", spec]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``prog``: how the usage line names the command (``libra actors`` when run through ``libra``)."""
    args = build_parser(*([prog] if prog else [])).parse_args(argv)
    configure(args.log_level, cache=True)
    log = get_logger("libra.actors")
    try:
        parse_endpoints(args.broker)  # BadAddress (a ValueError): said once here, not by every slot in a loop
        parse_dtype(args.dtype)
        if not 0.0 <= args.gpu_memory_fraction <= 1.0:
            raise ValueError(f"--gpu-memory-fraction must be within [0, 1], got {args.gpu_memory_fraction}")
        roles = parse_roles(args.roles) if args.roles else None
        gpu_roles = parse_roles(args.gpu_roles) if args.gpu_roles else None
        if gpu_roles is not None and any(r in ("action", "episode") for r in gpu_roles):
            raise ValueError("--gpu-roles takes engine roles only (rollout, train, hybrid)")
        check_lend(args.lend, roles, gpu_roles, args.gpu_role)
        if roles is not None:
            args.cpu_slots = len(roles)
        slots, gpu_reason = resolve_slots(args.cpu_slots, args.gpu_slots)
        n_found = sum(s.startswith("gpu") for s in slots)
        gpus, gpu_role_of, gpu_env, fallback, gpu_plan = gpu_layout(
            gpu_roles, [s for s in slots if s.startswith("gpu")], n_found, args.gpu_role, args.model_dir)
        cpu = [s for s in slots if s.startswith("cpu")]
        if fallback:  # engine slots with no GPU to go to run as extra CPU slots
            roles = (roles if roles is not None else ["action"] * len(cpu)) + fallback
            cpu = [f"cpu{i}" for i in range(len(roles))]
        slots = gpus + cpu
        # a tool module that fails, fails here, once (not in every action slot, restarted in a loop)
        if args.tools or "action" in (roles or ["action"]) or args.gpu_role == "action":
            from .tools import host_memory_mb, load_tools, user_handlers

            user_tools = load_tools(args.tools)
            user_handlers(user_tools, {}, host_cores=len(os.sched_getaffinity(0)), host_memory_mb=host_memory_mb())
            if user_tools:
                log.info("user_tools", tools={n: t.source for n, t in user_tools.items()})
    except ValueError as exc:  # ToolLoadError is one
        print(f"libra.actors: {exc}", file=sys.stderr)
        return 2
    n_gpu = len(gpus)
    if n_gpu == 0:
        log.warning("no_gpu_slots", reason=gpu_reason, decided=gpu_plan, cpu_slots=len(slots))
    else:
        log.info("gpu_slots", count=n_gpu, reason=gpu_reason, decided=gpu_plan)
    os.environ[DTYPE_ENV] = args.dtype  # the slots inherit the engine settings (libra.engines.device)
    os.environ[MEMORY_FRACTION_ENV] = str(args.gpu_memory_fraction)
    os.environ[NODE_GPUS_ENV] = str(max(1, n_found))
    if not slots:
        print("libra.actors: no slots to start (--cpu-slots 0 and no GPUs)", file=sys.stderr)
        return 2
    extra = []
    if args.no_sandbox:
        extra.append("--no-sandbox")
    if args.allow_unisolated:
        extra.append("--allow-unisolated")
    if args.no_direct:
        extra.append("--no-direct")
    for module in args.tools:
        extra += ["--tools", module]
    if args.log_level:
        extra += ["--log-level", args.log_level]
    for flag, value in (("--model-dir", args.model_dir), ("--run-dir", args.run_dir)):
        if value:
            extra += [flag, value]
    extra += ["--torch-threads", str(args.torch_threads), "--rollout-batch", str(args.rollout_batch),
              "--episode-concurrency", str(args.episode_concurrency)]
    try:
        slot_args = slot_arguments(slots, roles, args.actor_id_prefix, socket.gethostname(), gpu_role_of)
        lend_engine_slots(slot_args, args.lend)
    except ValueError as exc:
        print(f"libra.actors: {exc}", file=sys.stderr)
        return 2
    try:
        sup = Supervisor(args.broker, slots, capacity=args.capacity, restart=not args.no_restart,
                         extra_args=extra, slot_args=slot_args, slot_env=gpu_env)
    except ValueError as exc:  # a bad slot name, a GPU outside the CUDA_VISIBLE_DEVICES this host was given
        print(f"libra.actors: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stop())
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
