"""``python -m libra tree build|merge|show``: C-MLFQ prefix-tree files for operators.

- ``build --trace FILE --out TREE``: the offline profiler (:mod:`libra.commands.tree_profile`): learn a tree from
  logged trajectories in the trace format, to bootstrap a broker (``router_params = {tree = "TREE"}``, or
  as its ``--router-state`` file).
- ``merge A B ... --out TREE``: fold several trees (e.g. brokers' ``--router-state`` files, or per-rank trees)
  into one, count-weighted (``CausalPrefixTree.merge``).
- ``show TREE [--json] [--top N]``: what a tree holds: parameters, prompts, nodes, history, and the most
  visited first tool-return states with their remaining-length mean and P90.

Every command exits 0 on success, 1 when an input file is missing or unreadable (the message names the file
and the problem), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_parser", "summarize"]


def _thresholds(text: str) -> Any:
    from libra.policies.routing.baselines import NAMED_THRESHOLDS
    from libra.policies.routing.tool_state import SizeThresholds

    if text in NAMED_THRESHOLDS:
        return NAMED_THRESHOLDS[text]
    try:
        small, medium = (int(x) for x in text.split(","))
        return SizeThresholds(small, medium)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"expected 'default', 'r2e' or SMALL,MEDIUM payload sizes, got {text!r} ({exc})") from None


def summarize(tree: Any, top: int = 10) -> dict[str, Any]:
    """A JSON-ready summary of a :class:`~libra.policies.routing.prefix_tree.CausalPrefixTree`."""
    root = tree.global_tree.root
    firsts = sorted(root.children.items(), key=lambda kv: (-kv[1].stats.count, kv[0]))[:top]
    return {
        "params": {"window_size": tree.window_size, "max_prompts": tree.max_prompts,
                   "history_size": tree.history_size, "rebuild_interval": tree.rebuild_interval},
        "prompts": tree.num_prompts,
        "global_nodes": tree.global_tree.node_count,
        "history": len(tree.history),
        "trajectories": root.stats.count,
        "total_mean": root.stats.mean,
        "first_states": [{"state": key, "count": node.stats.count, "mean_remaining": node.stats.mean,
                          "p90_remaining": node.stats.p90} for key, node in firsts],
    }


def _fail(msg: str) -> int:
    print(f"libra tree: {msg}", file=sys.stderr)
    return 1


def _build(args: argparse.Namespace) -> int:
    from libra.policies.routing.prefix_tree import PrefixTreeError
    from libra.traces import TraceError, read_trace
    from libra.commands.tree_profile import profile_tree

    try:
        trajs = read_trace(args.trace)
    except (OSError, TraceError) as exc:
        return _fail(f"cannot read trace {args.trace}: {exc}")
    try:
        tree = profile_tree(trajs, args.thresholds, window_size=args.window, history_size=args.history,
                            max_prompts=args.max_prompts, rebuild_interval=args.rebuild_interval)
    except PrefixTreeError as exc:
        print(f"libra tree build: {exc}", file=sys.stderr)
        return 2
    try:
        tree.save(args.out)
    except OSError as exc:
        return _fail(f"cannot write {args.out}: {exc}")
    s = summarize(tree, 0)
    print(f"{args.out}: {len(trajs)} trajectories, {s['prompts']} prompts, {s['global_nodes']} global nodes")
    return 0


def _load(path: str) -> Any:
    from libra.policies.routing.prefix_tree import CausalPrefixTree

    return CausalPrefixTree.load(path)


def _merge(args: argparse.Namespace) -> int:
    from libra.policies.routing.prefix_tree import PrefixTreeError

    try:
        trees = [_load(p) for p in args.trees]
    except (OSError, UnicodeDecodeError, PrefixTreeError) as exc:
        return _fail(f"cannot read a tree: {exc}")
    merged = trees[0]
    for t in trees[1:]:
        merged.merge(t)
    try:
        merged.save(args.out)
    except OSError as exc:
        return _fail(f"cannot write {args.out}: {exc}")
    s = summarize(merged, 0)
    print(f"{args.out}: merged {len(trees)} trees, {s['trajectories']} trajectories at the root, "
          f"{s['prompts']} prompts, {s['global_nodes']} global nodes")
    return 0


def _show(args: argparse.Namespace) -> int:
    from libra.policies.routing.prefix_tree import PrefixTreeError

    try:
        tree = _load(args.tree)
    except (OSError, UnicodeDecodeError, PrefixTreeError) as exc:
        return _fail(f"cannot read {args.tree}: {exc}")
    s = summarize(tree, args.top)
    if args.json:
        print(json.dumps(s))
        return 0
    p = s["params"]
    print(f"{args.tree}: window {p['window_size']}, max prompts {p['max_prompts']}, history {p['history_size']}, "
          f"rebuild every {p['rebuild_interval']} steps")
    print(f"{s['trajectories']} trajectories learned (mean response {s['total_mean']:.0f} tokens), "
          f"{s['prompts']} prompts, {s['global_nodes']} global nodes, {s['history']} in history")
    if s["first_states"]:
        print(f"{'first tool-return state':<34} {'count':>7} {'mean left':>10} {'p90 left':>10}")
        for row in s["first_states"]:
            print(f"{row['state']:<34} {row['count']:>7} {row['mean_remaining']:>10.0f} {row['p90_remaining']:>10.0f}")
    return 0


def add_parser(sub: Any) -> None:
    """Register ``tree`` and its subcommands on the ``python -m libra`` subparsers."""
    t = sub.add_parser("tree", help="build, merge or show C-MLFQ prefix-tree files",
                       description="C-MLFQ causal prefix trees: bootstrap one from a trace (the offline profiler), "
                                   "merge brokers' or ranks' trees, or show what one holds.")
    tsub = t.add_subparsers(dest="tree_command", required=True)
    b = tsub.add_parser("build", help="learn a tree from a trace file (the offline profiler)",
                        description="Learn a prefix tree from logged trajectories (trace format of "
                                    "docs/trace-format.md), as the broker would have learned them.")
    b.add_argument("--trace", required=True, help="trace file (JSON Lines, one trajectory per line)")
    b.add_argument("--out", required=True, help="tree file to write (JSON)")
    b.add_argument("--thresholds", type=_thresholds, default="default",
                   help="payload size classes: 'default' (500/5000), 'r2e' (1000/12000) or SMALL,MEDIUM; must match "
                        "the broker router's 'thresholds' (default: %(default)s)")
    b.add_argument("--window", type=int, default=200, help="remaining-length samples kept per node (default 200)")
    b.add_argument("--history", type=int, default=5000, help="trajectories kept for rebuilds (default 5000)")
    b.add_argument("--max-prompts", type=int, default=10_000, help="per-prompt trees kept (default 10000)")
    b.add_argument("--rebuild-interval", type=int, default=50, help="steps between rebuilds (default 50; 0: never)")
    b.set_defaults(fn=_build)
    m = tsub.add_parser("merge", help="merge tree files into one (count-weighted)",
                        description="Merge prefix-tree files: means combine count-weighted, windows and "
                                    "histories concatenate in argument order.")
    m.add_argument("trees", nargs="+", help="tree files, in order")
    m.add_argument("--out", required=True, help="merged tree file to write")
    m.set_defaults(fn=_merge)
    s = tsub.add_parser("show", help="summarise a tree file", description="Summarise a prefix-tree file.")
    s.add_argument("tree", help="tree file")
    s.add_argument("--top", type=int, default=10, help="first tool-return states to list (default 10)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(fn=_show)
