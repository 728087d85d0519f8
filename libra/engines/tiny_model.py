"""A tiny, random-initialised causal LM with its own byte-level BPE tokenizer, built fully offline.

Role: give tests, examples and CPU benchmarks a *real* transformers model (same code paths as a
production checkpoint: ``AutoModelForCausalLM``/``AutoTokenizer``, KV cache, chat template,
``save_pretrained``) that needs no download and builds in about a second.

Contracts:

- :func:`ensure_tiny_model` returns a directory that loads with ``AutoModelForCausalLM.from_pretrained``
  and ``AutoTokenizer.from_pretrained`` (``HF_HUB_OFFLINE=1``; nothing is fetched).
- The build is deterministic: the same :class:`TinyModelSpec` gives bit-identical weights and the same
  tokenizer, whatever the caller's global RNG state (the build uses a forked RNG and leaves the
  caller's untouched).
- The build happens once per directory: a directory that already holds a model built from the same
  spec is reused; one built from a different spec raises :class:`TinyModelError` instead of being
  silently overwritten. Concurrent builders (e.g. two training ranks) are safe: each builds into a
  private temporary directory and renames it into place; the loser of the race discards its copy.
- Special tokens: ``<|pad|>`` (pad), ``<|endoftext|>``, ``<|im_start|>``/``<|im_end|>`` (chat markers,
  ``<|im_end|>`` is the eos token), ``<tool_call>``/``</tool_call>``, ``<tool_response>``/
  ``</tool_response>``. The chat template renders ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
  message and ``<|im_start|>assistant\\n`` as the generation prompt.

Not in this module: anything that serves or trains the model (see ``hf_rollout.py``, ``trainer.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # must precede the transformers import
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TinyModelError",
    "TinyModelSpec",
    "build_tiny_tokenizer",
    "default_cache_dir",
    "ensure_tiny_model",
]

PAD = "<|pad|>"
EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD,
    EOT,
    IM_START,
    IM_END,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

# Jinja chat template (ChatML-like). Written as one expression per message so that whitespace
# control cannot leak newlines into the rendered prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_SPEC_FILE = "libra_tiny_spec.json"

# Training text for the BPE merges. Written for this module: arithmetic, short prose, code and the
# chat/tool markup the RL examples use, so common fragments get their own tokens.
_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. A tiny model learns to count and to add.",
    "What is 12 + 30? The answer is 42. What is 7 * 6? The answer is 42 as well.",
    "Compute 3 + 4 = 7, 10 - 3 = 7, 2 * 8 = 16, 81 / 9 = 9, 100 - 58 = 42.",
    "Let x be 5. Then x + x = 10 and x * x = 25. Therefore the final answer is 25.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "import math\nresult = math.sqrt(16)\nprint(result)\n",
    "user: Please solve the problem step by step.\nassistant: First, read the question carefully.",
    "<tool_call>{\"name\": \"python\", \"arguments\": {\"code\": \"print(1 + 1)\"}}</tool_call>",
    "<tool_response>{\"stdout\": \"2\\n\", \"exit_code\": 0}</tool_response>",
    "The capital of France is Paris. The capital of Italy is Rome. Water boils at 100 degrees.",
    "Reinforcement learning improves a policy with rewards; a group of samples shares one prompt.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 40 50 64 100 128 256 512 1000",
)


class TinyModelError(RuntimeError):
    """A tiny-model directory is unusable (built from another spec, or half-written)."""


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Everything that determines a tiny model. Equal specs give bit-identical models.

    ``arch`` picks the transformers architecture (``qwen2`` or ``llama``). ``hidden_size`` must be
    divisible by ``num_heads``, and ``num_heads`` by ``num_kv_heads``. ``initializer_range`` is larger
    than the usual 0.02 so that the random model's next-token distributions are far from uniform,
    which makes log-probability checks in tests meaningful.
    """

    arch: Literal["qwen2", "llama"] = "qwen2"
    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 2  # head_dim 32: the smallest head size vLLM's CPU attention supports
    num_kv_heads: int = 1
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    initializer_range: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("qwen2", "llama"):
            raise ValueError(f"TinyModelSpec.arch: unknown architecture {self.arch!r} (known: 'llama', 'qwen2')")
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyModelSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyModelSpec.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinyModelSpec.num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"TinyModelSpec.vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), "
                f"got {self.vocab_size}"
            )

    def fingerprint(self) -> str:
        """A short stable hash of the spec; names default cache directories."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$LIBRA_CACHE_DIR`` if set, else ``~/.cache/libra``."""
    env = os.environ.get("LIBRA_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "libra"


def build_tiny_tokenizer(vocab_size: int = 512):  # -> transformers.PreTrainedTokenizerFast
    """Train the byte-level BPE on the built-in corpus and wrap it as a transformers fast tokenizer.

    Deterministic (no randomness in BPE training on a fixed corpus). Any NFC-normalised Unicode string
    round-trips through encode/decode because the base alphabet is all 256 bytes (input is NFC-normalised
    first, as Qwen2's tokenizer does).
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # NOTE: AutoTokenizer loads a ``qwen2`` checkpoint through ``Qwen2Tokenizer``, which rebuilds the
    # normalizer and pre-tokenizer itself (NFC + its split regex + ByteLevel without regex) instead of
    # reading them from tokenizer.json. Training with exactly that pipeline makes the tokenizer we
    # build and the one every consumer loads agree token for token, for both architectures.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD, IM_END)],
        padding_side="left",  # generation pads on the left
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_config(spec: TinyModelSpec, tokenizer):  # -> transformers.PretrainedConfig
    from transformers import LlamaConfig, Qwen2Config

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.initializer_range,
        "tie_word_embeddings": False,  # separate lm_head: simpler weight sync (no aliased tensors)
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    if spec.arch == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def _build_into(spec: TinyModelSpec, out: Path) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tiny_tokenizer(spec.vocab_size)
    config = _build_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG exactly as it was
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(EOT)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / _SPEC_FILE).write_text(json.dumps(asdict(spec), sort_keys=True))


def ensure_tiny_model(path: str | os.PathLike[str] | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Return a directory holding the tiny model for ``spec`` (default spec if None), building it once.

    ``path`` defaults to ``default_cache_dir() / f"tiny-{spec.fingerprint()}"``. Raises
    :class:`TinyModelError` if ``path`` exists but holds something else (another spec, or a
    directory that is not a tiny model), so a typo can never overwrite user data.
    """
    spec = spec or TinyModelSpec()
    target = Path(path) if path is not None else default_cache_dir() / f"tiny-{spec.fingerprint()}"
    if _is_built(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _build_into(spec, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            os.rename(tmp, target)  # atomic; fails if another builder got there first
        except OSError:
            if not _is_built(target, spec):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_built(target: Path, spec: TinyModelSpec) -> bool:
    if not target.exists():
        return False
    spec_file = target / _SPEC_FILE
    if not spec_file.is_file():
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()  # an empty directory is a fine place to build
            return False
        raise TinyModelError(f"{target} exists and is not a Libra tiny-model directory (no {_SPEC_FILE})")
    found = json.loads(spec_file.read_text())
    if found != asdict(spec):
        raise TinyModelError(f"{target} holds a tiny model built from another spec: {found} != {asdict(spec)}")
    return True
