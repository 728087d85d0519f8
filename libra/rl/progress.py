"""What ``libra run`` shows while a job runs: a step bar and, beside it, the episodes of the step in progress.

:class:`JobProgress` is fed what the driver polls: :meth:`JobProgress.poll` with the broker's
``episodes_collected`` (finished episodes in groups not yet cut into a batch: the next step's episodes;
with a policy-lag bound above 0 they may include a later step's, so the count is capped at the step's
``prompts_per_step x group_size``) and whether a step is training (its episodes are all done: the bar is
full and says ``training``); :meth:`JobProgress.step` with each step
record (the step bar advances with reward, accuracy and tokens/s; the episode bar starts over for the next
step). While the bars are live, console log lines (``libra.logging``) and job notes go through
``tqdm.write`` above the bars instead of breaking into them, and so do the lines the job's processes write
to stderr when ``libra run`` started them on a terminal (:func:`children_above_bars`). Disabled (``--no-progress``) it draws nothing
and job notes become ``job_note`` log lines.

:func:`quiet_progress` is what ``--no-progress`` also switches off, for as long as the job runs: transformers'
progress bars ("Loading weights", GGUF de-quantisation) in this process
(``transformers.utils.logging.disable_progress_bar()``) and in every process started meanwhile (the broker,
the supervisor and its actor slots inherit ``HF_HUB_DISABLE_PROGRESS_BARS=1`` and ``TQDM_DISABLE=1``). The
previous settings come back when the block ends.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, TextIO

from libra.logging import console_writer, current_console_writer, get_logger

__all__ = ["QUIET_ENV", "JobProgress", "children_above_bars", "quiet_progress"]

log = get_logger("libra.rl")

#: What :func:`quiet_progress` puts in the environment of the processes started while it is active.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


@contextmanager
def quiet_progress() -> Iterator[None]:
    """No progress bars from transformers/huggingface_hub/tqdm here or in processes started inside the block
    (see the module docstring); restores the environment and transformers' switch afterwards."""
    saved = {k: os.environ.get(k) for k in QUIET_ENV}
    os.environ.update(QUIET_ENV)
    hf_logging: Any = None
    was_on = False
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging as hf_logging

        was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if hf_logging is not None and was_on:
            hf_logging.enable_progress_bar()


@contextmanager
def children_above_bars(enabled: bool = True) -> Iterator[threading.Thread | None]:
    """Processes started inside the block (``libra run``'s broker and actors, and every slot their
    supervisor starts later) write their stderr into a pipe; a thread prints each of its lines above the
    live bars (the active ``libra.logging.console_writer``, i.e. ``tqdm.write``) or, with no bar, to this
    process's stderr, so a warning from an actor slot does not break into the bars. The children log in the
    console format (``LIBRA_LOG_JSON=0``), as they would on the terminal; of a line rewritten with carriage
    returns (another progress bar) only the last state is printed. This process's own stderr is back when
    the block ends; the thread ends when the last child closes the pipe. Yields that thread (None when not
    ``enabled``: nothing changes)."""
    if not enabled:
        yield None
        return
    sys.stderr.flush()
    saved = os.dup(2)
    r, w = os.pipe()
    env_before = os.environ.get("LIBRA_LOG_JSON")
    os.environ["LIBRA_LOG_JSON"] = "0"
    os.dup2(w, 2)
    os.close(w)
    pump = threading.Thread(target=_pump, args=(r, saved), name="libra-child-stderr", daemon=True)
    pump.start()
    try:
        yield pump
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes this process's end of the pipe: EOF once the children are gone
        if env_before is None:
            os.environ.pop("LIBRA_LOG_JSON", None)
        else:
            os.environ["LIBRA_LOG_JSON"] = env_before


def _pump(r: int, out_fd: int) -> None:
    """Copy the lines of pipe ``r`` to the console writer or ``out_fd`` until EOF; then close both."""
    buf = b""
    try:
        while chunk := os.read(r, 65536):
            *lines, buf = (buf + chunk).split(b"\n")
            for raw in lines:
                _emit(raw, out_fd)
        if buf:
            _emit(buf, out_fd)
    finally:
        os.close(r)
        os.close(out_fd)


def _emit(raw: bytes, out_fd: int) -> None:
    text = raw.decode("utf-8", errors="replace").rstrip("\r").split("\r")[-1]
    writer = current_console_writer()
    if writer is not None:
        writer(text)
    else:
        os.write(out_fd, text.encode("utf-8", errors="replace") + b"\n")


class JobProgress:
    """The step bar and the per-episode bar of one job (see the module docstring). ``file``: where the bars
    and routed lines go (default ``sys.stderr``)."""

    def __init__(self, name: str, steps: int, episodes_per_step: int, *, enabled: bool = True,
                 file: TextIO | None = None) -> None:
        self.enabled = enabled
        self.per_step = max(1, episodes_per_step)
        self.steps_seen = 0
        self._file = file
        self._route: Any = None
        self.steps_bar: Any = None
        self.episodes_bar: Any = None
        if enabled:
            from tqdm import tqdm  # type: ignore[import-untyped]

            out = file if file is not None else sys.stderr
            self.steps_bar = tqdm(total=steps, desc=f"libra run {name}", unit="step", position=0, file=out,
                                  mininterval=0)
            self.episodes_bar = tqdm(total=self.per_step, desc="  episodes of step 1", unit="ep", position=1,
                                     leave=False, file=out, mininterval=0,  # no rate: the count jumps per poll
                                     bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
            self.total_steps = steps
            self._route = console_writer(self.write)
            self._route.__enter__()

    def write(self, text: str) -> None:
        """One line above the live bars (a job note, a routed log line); a ``job_note`` log line without bars."""
        if not self.enabled:
            log.warning("job_note", note=text)
            return
        from tqdm import tqdm

        tqdm.write(text, file=self._file if self._file is not None else sys.stderr)

    def poll(self, episodes_collected: int, training: bool = False) -> None:
        """The broker's latest poll: the episodes finished toward the next batch, and whether a step trains."""
        if self.episodes_bar is None:
            return
        # the batch in training holds the step's episodes (all done); else those collected so far
        self.episodes_bar.n = self.per_step if training else min(self.per_step, max(0, int(episodes_collected)))
        self.episodes_bar.set_postfix_str("training" if training else "", refresh=False)
        self.episodes_bar.refresh()

    def step(self, rec: dict[str, Any]) -> None:
        """A step record arrived: advance the step bar, start the episode bar over for the next step."""
        self.steps_seen += 1
        if self.steps_bar is None:
            return
        self.steps_bar.set_postfix(reward=f"{rec['reward_mean']:.2f}", acc=f"{rec['accuracy']:.2f}",
                                   tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
        self.steps_bar.update(1)
        if self.episodes_bar is None:
            return
        if self.steps_seen >= self.total_steps:  # no step after the last one: no episode bar either
            self.episodes_bar.close()
            self.episodes_bar = None
            return
        self.episodes_bar.set_postfix_str("", refresh=False)  # before reset() draws it
        self.episodes_bar.set_description_str(f"  episodes of step {self.steps_seen + 1}", refresh=False)
        self.episodes_bar.reset(total=self.per_step)

    def close(self) -> None:
        if self._route is not None:
            self._route.__exit__(None, None, None)
            self._route = None
        for bar in (self.episodes_bar, self.steps_bar):
            if bar is not None:
                bar.close()
        self.episodes_bar = self.steps_bar = None

    def __enter__(self) -> "JobProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
