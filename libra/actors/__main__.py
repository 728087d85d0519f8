"""``python -m libra.actors --broker URL [--cpu-slots N] [--gpu-slots auto|N]``: run this host's actors."""

from __future__ import annotations

import argparse
import signal
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
    p.add_argument("--log-level", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level, cache=True)
    log = get_logger("libra.actors")
    try:
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
    sup = Supervisor(args.broker, slots, capacity=args.capacity, restart=not args.no_restart, extra_args=extra)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stop())
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
