"""Job datasets (``[data]``): train and eval files read through the ``datasets`` library, in a seeded order.

Contracts:

- A dataset is a JSONL file (``.jsonl``/``.json``: one object a line), a Parquet file (``.parquet``) or a
  local Hugging Face ``datasets`` directory written by ``Dataset.save_to_disk`` (a ``DatasetDict`` there must
  hold one split, or a ``train`` split). Nothing is downloaded.
- :func:`load_rows` returns plain dicts, one per row, after checking the file and the fields:
  a missing file, a malformed JSON line (by line number) or an unreadable file raises
  :class:`~libra.config.ConfigError` naming the file and the ``[data]`` key; a ``prompt_field`` (or
  ``answer_field``) that no row has raises one naming the fields that exist. A prompt is a string or a list
  of chat messages (``{"role", "content"}`` mappings).
- Order: the whole run reads the rows epoch after epoch; epoch ``e`` is a permutation of the rows by
  ``random.Random(seed * 1_000_003 + e)`` (``shuffle = true``) or the file order. :class:`DataOrder` maps a
  position (rows consumed since the run began) to ``(epoch, index)`` and to the row; the same seed gives the
  same order in every process, so a resumed job continues from a saved position (:class:`Cursor`, written
  as ``RUN/data_cursor.json`` at each checkpoint) with exactly the rows that followed. The saved position
  counts every row handed out when the checkpointed step was recorded, so with ``max_policy_lag > 0`` rows
  that were in flight then (admitted for a later step) are not run again after a resume.
- Rows go to the environment's ``from_row`` as :func:`libra.envs.contract.dataset_row` makes them: every
  field kept, the prompt copied to ``row["prompt"]``; ``answer_field``, when set, is copied to
  ``row["answer"]`` (unless the record has an ``answer`` already).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from libra.config import ConfigError
from libra.envs.contract import dataset_row

__all__ = ["CURSOR_FILE", "Cursor", "DataOrder", "JobData", "check_data", "job_data", "load_rows", "read_cursor", "write_cursor"]

CURSOR_FILE = "data_cursor.json"


def _read_jsonl(path: Path, key: str) -> None:
    """Check every line of a JSONL file parses to an object (the ``datasets`` JSON reader's errors do not say
    which line)."""
    with path.open("r", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"[data] {key} = {str(path)!r}: line {n} is not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"[data] {key} = {str(path)!r}: line {n} is not a JSON object")


def _starts_with(path: Path, char: str) -> bool:
    """Whether the file's first non-blank character is ``char``."""
    with path.open("r", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                return line.lstrip().startswith(char)
    return False


def _read_json_array(path: Path, key: str) -> list[dict[str, Any]]:
    """The objects of a ``.json`` file holding one JSON array; the error names the element that is not one."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"[data] {key} = {str(path)!r}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    for n, obj in enumerate(rows):
        if not isinstance(obj, dict):
            raise ConfigError(f"[data] {key} = {str(path)!r}: element {n} of the array is not a JSON object")
    return rows


def _open(path: Path, key: str) -> Any:
    """The file or directory at ``path`` as a ``datasets.Dataset``."""
    try:
        import datasets  # the 'train' extra
    except ImportError as exc:  # pragma: no cover - the extra is installed with the trainer
        raise ConfigError(f"[data] {key}: reading datasets needs the 'datasets' package ({exc}); "
                          "pip install 'libra[train]'") from None
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" in ds:
                    ds = ds["train"]
                elif len(ds) == 1:
                    ds = next(iter(ds.values()))
                else:
                    raise ConfigError(f"[data] {key} = {str(path)!r}: a DatasetDict with splits {sorted(ds)}; "
                                      "point at one split's directory")
            return ds
        suffix = path.suffix.lower()
        if suffix == ".json" and _starts_with(path, "["):  # one JSON array of objects, not JSON Lines
            return datasets.Dataset.from_list(_read_json_array(path, key))
        if suffix in (".jsonl", ".json"):
            _read_jsonl(path, key)
            return datasets.Dataset.from_json(str(path), keep_in_memory=True)
        if suffix == ".parquet":
            return datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001  (pyarrow / datasets errors: say which file)
        raise ConfigError(f"[data] {key} = {str(path)!r}: cannot read it: {type(exc).__name__}: {exc}") from None
    raise ConfigError(f"[data] {key} = {str(path)!r}: unknown format (a .jsonl, .json or .parquet file, or a "
                      "directory written by datasets' save_to_disk)")


def _check_prompt(value: Any, path: Path, key: str, field: str, n: int) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in value):
        return
    raise ConfigError(f"[data] {key} = {str(path)!r}: row {n}: prompt_field {field!r} must hold a string or a "
                      f"list of chat messages ({{'role', 'content'}}), got {type(value).__name__}")


def load_rows(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "",
              key: str = "train", base: str | Path | None = None) -> list[dict[str, Any]]:
    """The rows of dataset ``path`` (relative paths resolve against ``base``, the job file's directory, when
    given and the path does not exist as written) as plain dicts; see the module contracts."""
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and base is not None:
        p = Path(base) / p
    if not p.exists():
        raise ConfigError(f"[data] {key} = {str(path)!r}: no such file or directory")
    ds = _open(p, key)
    fields = list(ds.column_names)
    for k, f in (("prompt_field", prompt_field), ("answer_field", answer_field)):
        if f and f not in fields:
            raise ConfigError(f"[data] {k} = {f!r}: {str(p)!r} has no such field (fields: {', '.join(fields) or 'none'})")
    records = [dict(r) for r in ds]
    if not records:
        raise ConfigError(f"[data] {key} = {str(p)!r}: the dataset has no rows")
    rows = []
    for n, r in enumerate(records, 1):
        _check_prompt(r.get(prompt_field), p, key, prompt_field, n)
        row = dataset_row(r, prompt_field)
        if answer_field:
            row.setdefault("answer", r[answer_field])
        rows.append(row)
    return rows


@dataclass(frozen=True, slots=True)
class Cursor:
    """A position in the data order: ``position`` rows consumed, which is row ``index`` of epoch ``epoch``;
    ``step`` is the last trained step (global numbering) when it was saved, ``checkpoint`` that step's
    checkpoint directory."""

    position: int
    epoch: int
    index: int
    step: int = 0
    checkpoint: str = ""


class DataOrder:
    """The run's row order over ``epochs`` epochs of ``rows`` (see the module contracts)."""

    def __init__(self, rows: list[dict[str, Any]], *, seed: int, shuffle: bool = True, epochs: int = 1) -> None:
        if not rows:
            raise ValueError("no rows")
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.rows, self.seed, self.shuffle, self.epochs = rows, seed, shuffle, epochs
        self._perms: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.rows) * self.epochs

    def perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._perms[epoch] = order
        return self._perms[epoch]

    def locate(self, position: int) -> tuple[int, int]:
        """``(epoch, index within the epoch)`` of ``position``."""
        return divmod(position, len(self.rows))

    def cursor(self, position: int, step: int = 0, checkpoint: str = "") -> Cursor:
        e, i = self.locate(position)
        return Cursor(position, e, i, step, checkpoint)

    def take(self, start: int, n: int | None = None) -> list[dict[str, Any]]:
        """The rows at positions ``start``, ``start + 1``, ... (at most ``n``; all that remain in the last
        epoch when ``n`` is None)."""
        end = len(self) if n is None else min(len(self), start + n)
        out = []
        for pos in range(start, end):
            e, i = self.locate(pos)
            out.append(self.rows[self.perm(e)[i]])
        return out


def write_cursor(run_dir: str | Path, cursor: Cursor) -> Path:
    """Save ``cursor`` as ``RUN/data_cursor.json`` (atomically)."""
    p = Path(run_dir) / CURSOR_FILE
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(asdict(cursor), sort_keys=True))
    tmp.replace(p)
    return p


def read_cursor(run_dir: str | Path) -> Cursor | None:
    """The saved cursor of ``run_dir``, or None when there is none; a malformed file is a ConfigError."""
    p = Path(run_dir) / CURSOR_FILE
    if not p.exists():
        return None
    try:
        return Cursor(**json.loads(p.read_text()))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{p}: not a data cursor ({exc})") from None


@dataclass
class JobData:
    """What a job hands the broker: ``rows`` (the data order from ``row_offset`` on), the eval rows, and the
    order itself (for the cursor saved at each checkpoint)."""

    rows: list[dict[str, Any]]
    order: DataOrder
    row_offset: int = 0
    step_offset: int = 0
    steps: int = 1
    eval_rows: list[dict[str, Any]] = field(default_factory=list)

    def cursor(self, position: int, step: int, checkpoint: str) -> Cursor:
        return self.order.cursor(position, step, checkpoint)

    def spec(self) -> dict[str, Any]:
        """The ``JobSubmit.spec`` entries this data sets (``libra.broker.job_host.JobSpec``)."""
        return {"steps": self.steps, "step_offset": self.step_offset, "row_offset": self.row_offset,
                "eval_rows": self.eval_rows}


def resume_point(run_dir: str | Path, steps: int) -> tuple[Cursor, Path]:
    """Where ``libra run --resume`` continues a job of ``steps`` steps in ``run_dir``: the saved cursor and the
    checkpoint it names (a transformers directory the rollout and trainer slots start from). A run without a
    cursor, one already finished or a checkpoint that cannot be a starting model is a ConfigError."""
    cur = read_cursor(run_dir)
    if cur is None:
        raise ConfigError(f"--resume: {Path(run_dir) / CURSOR_FILE} does not exist: the job saved no checkpoint "
                          "to resume from ([job] checkpoint_every writes one every N steps)")
    if cur.step >= steps:
        raise ConfigError(f"--resume: the run in {run_dir} already trained step {cur.step} of [job] steps = {steps}; "
                          "raise [job] steps to train on")
    ck = Path(cur.checkpoint)
    if not (ck / "config.json").is_file() or not (ck / "model.safetensors").is_file():
        raise ConfigError(f"--resume: checkpoint {ck} is not a transformers directory (config.json and "
                          "model.safetensors; a sharded fsdp checkpoint cannot start rollout engines)")
    return cur, ck


def check_data(cfg: Any) -> None:
    """Read ``[data] train`` and ``eval`` once (ConfigError naming the file and key), before a job starts."""
    d = cfg.data
    for key in ("train", "eval"):
        if getattr(d, key):
            load_rows(getattr(d, key), prompt_field=d.prompt_field, answer_field=d.answer_field, key=key)


def job_data(cfg: Any, env_rows: Callable[[int, int], list[dict[str, Any]]], *, base: str | Path | None = None,
             cursor: Cursor | None = None) -> JobData:
    """The rows of job ``cfg`` (a :class:`~libra.rl.config.JobConfig`): from ``[data] train`` in its seeded
    order, or else ``env_rows(n, seed)`` (the environment's ``make_problems`` as rows); from ``cursor`` on for
    a resumed job. The broker gets enough rows for the remaining steps plus a margin for dropped and filtered
    groups (it reuses them in order only when drops exhaust them). Eval rows: ``[data] eval`` (the first
    ``[eval] prompts`` when set), or ``[eval] prompts`` environment problems drawn with another seed, or none."""
    j, d, e = cfg.job, cfg.data, cfg.eval
    start, done = (cursor.position, cursor.step) if cursor else (0, 0)
    steps = j.steps - done
    need = steps * j.prompts_per_step
    n = need * 4 + 64 + (steps * cfg.grpo.max_extra_groups if cfg.grpo.filter_zero_variance else 0)
    if d.train:
        order = DataOrder(load_rows(d.train, prompt_field=d.prompt_field, answer_field=d.answer_field, key="train",
                                    base=base), seed=j.seed, shuffle=d.shuffle, epochs=d.epochs)
        if len(order) - start < need:
            raise ConfigError(f"[data] train = {d.train!r}: {len(order.rows)} rows x epochs {d.epochs} leave "
                              f"{len(order) - start} from position {start}, the job needs {need} ([job] steps "
                              f"{steps} x prompts_per_step {j.prompts_per_step}): raise [data] epochs")
    else:
        order = DataOrder(env_rows(start + n, j.seed), seed=j.seed, shuffle=False, epochs=1)
    ev: list[dict[str, Any]] = []
    if d.eval:
        ev = load_rows(d.eval, prompt_field=d.prompt_field, answer_field=d.answer_field, key="eval", base=base)
        ev = ev[: e.prompts] if e.prompts else ev
    elif e.prompts:
        ev = env_rows(e.prompts, j.seed * 1_000_003 + 7919)
    return JobData(order.take(start, n), order, start, done, steps, ev)
