"""``python -m libra.bench.gpu_figures OUT_DIR``: the key figures of a ``scripts/gpu-check.sh`` run, read from
its files, one line each, for ``summary.txt`` and ``BENCHMARKS.md``.

Lines: the card; the checks (``01-checks.log``'s ``RESULT`` records of :mod:`libra.bench.gpu_checks`: bf16 loss
first/last and share of weights moved against fp32, CUDA memory before/after each role switch, the OOM's
type and what it gave back); pytest's final line; the job's GPU memory (``03-gpu.csv``: the first sample,
before any slot touched the GPU, and the peak) and utilisation, what ``libra status --json`` saw
(``03-status.jsonl``), and how the rollout slots loaded weights (the actors' records in ``03-job.log``); the
training line of ``bench engines``. A file that is missing or unreadable gives a line saying so; nothing
here raises.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["figures"]


def _read(out: Path, name: str) -> str:
    return (out / name).read_text(errors="replace")


def _card(out: Path) -> list[str]:
    for line in _read(out, "00-setup.log").splitlines():
        if line.startswith("card "):
            return [f"card: {line[5:].strip()}"]
    return ["card: not in 00-setup.log"]


def _mib(mem: dict[str, Any], stage: str) -> str:
    """CUDA's allocated MiB at ``stage``, or the process's RSS where there is no CUDA reading."""
    m = mem.get(stage) or {}
    return str(m["allocated"]) if "allocated" in m else f"rss {m.get('rss', '?')}"


def _check_lines(r: dict[str, Any]) -> list[str]:
    name, ok = r.get("check"), "ok" if r.get("ok") else "FAILED"
    if "error" in r and "losses" not in r and "memory_mib" not in r:  # the check raised before its figures
        return [f"{name}: {ok}: {r['error']}"]
    if name == "bf16":
        ref = (f", fp32 {r['fp32_moved_share_first_step']:.1%}, ratio {r['bf16_over_fp32']}"
               if "fp32_moved_share_first_step" in r else "")
        return [f"bf16 learning ({r.get('model')}, {r.get('device')}): {ok}; params {','.join(r['param_dtypes'])}; "
                f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f} over {r['steps']} steps at lr {r['lr']}; "
                f"weights moved by step 1 {r['moved_share_first_step']:.1%}{ref}"]
    if name == "switch":
        mem = r.get("memory_mib", {})
        stages = ("start", "rollout", "rollout_closed", "train", "train_closed", "rollout_again", "end")
        lines = [f"role switch ({r.get('model')}, {r.get('slot')}): {ok}; freed without gc {r.get('freed_without_gc')}; "
                 f"memory returned {r.get('memory_returned', 'n/a (CPU)')}",
                 "  MiB allocated " + ", ".join(f"{s} {_mib(mem, s)}" for s in stages)]
        for sw in (r.get("actor_record") or {}).get("role_switches", []):
            b, a = sw.get("memory_before", {}), sw.get("memory_after", {})
            key = "allocated_bytes" if "allocated_bytes" in b else "rss_bytes"
            lines.append(f"  actor record: switch {sw.get('switch')} to {sw.get('role')} released "
                         f"{sw.get('released')}: {key} {b.get(key, 0) / 2**20:.0f} -> {a.get(key, 0) / 2**20:.0f} MiB, "
                         f"gc_needed {sw.get('gc_needed')}")
        return lines
    if name == "oom":
        mem = r.get("memory_mib", {})
        return [f"trainer OOM ({r.get('model')}, {r.get('mode')}): {ok}; {r.get('error_type')} code "
                f"{r.get('error_code')}; weights unchanged {r.get('version_unchanged')}, trained on "
                f"{r.get('recovered')}; MiB allocated before {_mib(mem, 'before')}, after the failure "
                f"{_mib(mem, 'after_failure')}" + (f"; error {r['error']}" if not r.get("ok") else "")]
    return [f"{name}: {ok}"]


def _checks(out: Path) -> list[str]:
    lines = []
    for line in _read(out, "01-checks.log").splitlines():
        if line.startswith("RESULT "):
            lines += _check_lines(json.loads(line[7:]))
    return lines or ["checks: no RESULT lines in 01-checks.log"]


def _pytest(out: Path) -> list[str]:
    text = _read(out, "02-pytest-gpu.log")
    final = [ln for ln in text.splitlines() if re.match(r"^=+ .*\b(passed|failed|error|skipped|no tests ran)\b", ln)]
    bad = [ln for ln in text.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    return [f"pytest tests/gpu: {final[-1].strip('= ') if final else 'no final line (killed?)'}", *bad[:10]]


def _gpu_csv(out: Path) -> list[str]:
    used, util = [], []
    for line in _read(out, "03-gpu.csv").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 4 and cells[1].endswith("MiB"):
            used.append(float(cells[1].split()[0]))
            util.append(float(cells[3].split()[0]))
    if not used:
        return ["job GPU samples: none in 03-gpu.csv"]
    return [f"job GPU memory.used: {used[0]:.0f} MiB before the job, peak {max(used):.0f} MiB "
            f"(+{max(used) - used[0]:.0f}); utilisation peak {max(util):.0f} %, mean {sum(util) / len(util):.0f} % "
            f"over {len(used)} samples"]


def _status(out: Path) -> list[str]:
    rows = [json.loads(ln) for ln in _read(out, "03-status.jsonl").splitlines() if ln.strip()]
    answered = [r["status"] for r in rows if "status" in r]
    gpu: dict[str, float] = {}
    kinds: set[str] = set()
    for s in answered:
        for a in s.get("actors", []):
            kinds.update(a.get("kinds") or [])
            g = a.get("gpu") or {}
            if g:
                gpu[a["id"]] = max(gpu.get(a["id"], 0.0), g.get("memory_used_bytes", 0.0) / 2**20)
    peak = ", ".join(f"{k} {v:.0f}" for k, v in sorted(gpu.items())) or "no actor reported a GPU sample"
    return [f"libra status --json: {len(answered)}/{len(rows)} samples answered; kinds seen {sorted(kinds)}; "
            f"GPU actors' peak memory used (MiB) {peak}"]


def _actors(out: Path) -> list[str]:
    text = _read(out, "03-job.log")
    _, _, records = text.partition("== the actors' records")
    loads: dict[str, int] = {}
    n = 0
    for line in records.splitlines():
        if line.startswith("{"):
            n += 1
            rec = json.loads(line)
            for k in ("torch_loads", "dataplane_loads", "file_loads"):
                loads[k] = loads.get(k, 0) + int(rec.get(k, 0) or 0)
    rc = re.findall(r"^job rc=(\S+)", _read(out, "summary.txt"), re.M)
    return [f"job rc {rc[-1] if rc else '?'}; {n} actor records; weight loads {loads or 'none recorded'}"]


def _bench(out: Path) -> list[str]:
    lines = _read(out, "04-bench.log").splitlines()
    for i, line in enumerate(lines):
        if line.startswith("training step"):
            return ["bench engines: " + " | ".join(x.strip() for x in lines[i:i + 3])]
    return ["bench engines: no training table in 04-bench.log"]


def figures(out: str | Path) -> list[str]:
    """The figure lines of the run in ``out`` (see the module docstring)."""
    out = Path(out)
    parts: list[Callable[[Path], list[str]]] = [_card, _checks, _pytest, _gpu_csv, _status, _actors, _bench]
    lines: list[str] = []
    for part in parts:
        try:
            lines += part(out)
        except Exception as exc:  # noqa: BLE001 - a missing or cut file is a line, not a failure
            lines.append(f"{part.__name__.strip('_')}: n/a ({type(exc).__name__}: {exc})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m libra.bench.gpu_figures OUT_DIR", file=sys.stderr)
        return 2
    print("\n".join(figures(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
