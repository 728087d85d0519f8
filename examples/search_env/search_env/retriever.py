"""BM25 retrieval over the shipped corpus, with the ``bm25s`` library.

:class:`Retriever` indexes a list of passages (``{"id", "title", "text"}``) once and answers
``search(query, k)`` with the ``k`` best passages and their BM25 scores (passages that share no term
with the query score 0 and are left out). :func:`default_retriever` is the index of the shipped corpus,
built once per process on first use (about 50 ms for 300 passages) and shared by all threads.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from .corpus import DATA_DIR

__all__ = ["MAX_K", "Retriever", "default_retriever", "format_passages", "load_corpus"]

MAX_K = 10


def load_corpus(path: Path = DATA_DIR / "corpus.jsonl") -> list[dict[str, str]]:
    """The passages of a corpus JSONL file; raises ValueError naming the file and line on a bad one."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append({"id": str(row["id"]), "title": str(row.get("title", "")), "text": str(row["text"])})
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: a passage needs 'id' and 'text': {exc!r}") from None
    return out


class Retriever:
    """A BM25 index over ``docs`` (English stopwords removed, no stemming)."""

    def __init__(self, docs: list[dict[str, str]]) -> None:
        import bm25s

        logging.getLogger("bm25s").setLevel(logging.WARNING)  # its index build logs at debug level
        if not docs:
            raise ValueError("cannot index an empty corpus")
        self._bm25s = bm25s
        self.docs = docs
        self.index = bm25s.BM25()
        self.index.index(self._tokenize([f"{d['title']} {d['text']}" for d in docs]), show_progress=False)
        self._lock = threading.Lock()  # retrieve() is not documented as thread-safe

    def _tokenize(self, texts: list[str]) -> Any:
        return self._bm25s.tokenize(texts, stopwords="en", show_progress=False)

    def search(self, query: str, k: int = 3) -> list[dict[str, Any]]:
        """The ``k`` best passages for ``query`` (best first), each with its ``score``."""
        k = max(1, min(int(k), MAX_K, len(self.docs)))
        tokens = self._tokenize([query])
        if not any(len(ids) for ids in tokens.ids):  # only stopwords or punctuation: nothing matches
            return []
        with self._lock:
            idx, scores = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [{**self.docs[int(i)], "score": round(float(s), 4)} for i, s in zip(idx[0], scores[0]) if s > 0]


def format_passages(hits: list[dict[str, Any]]) -> str:
    """What the model sees between ``<information>`` tags: numbered passages with their titles."""
    if not hits:
        return "No passage matches the query."
    return "\n".join(f"Doc {n} ({h['title']}): {h['text']}" for n, h in enumerate(hits, 1))


_default: Retriever | None = None
_default_lock = threading.Lock()


def default_retriever() -> Retriever:
    """The index of the shipped corpus (built on first call, then shared)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Retriever(load_corpus())
        return _default
