"""The example's corpus and question sets, generated from one seed, so answers exist nowhere else.

Every entity is a made-up settlement with made-up facts (its founder, the year it was founded, its
region, the river through it and what it exports). Each entity gets three short passages, and each
question asks for one fact of one entity by its name, so the answer can only be found by searching the
corpus (the model cannot know it). The same seed gives the same corpus and questions, byte for byte.

The generated files ship with the package (``search_env/data/``): ``corpus.jsonl`` (``{"id", "title",
"text"}`` per passage), ``train.jsonl`` and ``eval.jsonl`` (``{"id", "question", "answer"}`` per line,
the format ``[data]`` of a job file reads). Regenerate them with ``python -m search_env.corpus``; a test
checks that the shipped files are what the generator makes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

__all__ = ["DATA_DIR", "SEED", "generate", "passages", "questions", "write"]

SEED = 26
DATA_DIR = Path(__file__).resolve().parent / "data"
ENTITIES = 100  # three passages each: 300 passages
TRAIN, EVAL = 240, 60

_ONSETS = ["br", "k", "v", "t", "m", "s", "dr", "qu", "z", "h", "l", "gr", "th", "p", "f", "n"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "io", "ou"]
_CODAS = ["rn", "l", "th", "sk", "m", "nd", "r", "v", "x", "s", "lt", "n"]
_GIVEN = ["Mira", "Tobin", "Selka", "Oren", "Vasha", "Idris", "Lune", "Corvin", "Yara", "Hollis", "Senna",
          "Brannoc", "Ilse", "Dorran", "Fenna", "Kestrel", "Aldo", "Nerys", "Pell", "Rowan"]
_EXPORTS = ["copper bells", "blue salt", "glass beads", "smoked eel", "cedar oil", "wool rugs", "tin lamps",
            "rye flour", "amber combs", "slate tiles", "honey wine", "silk rope", "clay pipes", "iron nails"]


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
    return w.capitalize()


def _unique(rng: random.Random, n: int, syllables: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = _word(rng, syllables)
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def generate(seed: int = SEED, entities: int = ENTITIES) -> list[dict[str, Any]]:
    """The entities (name and facts), from a private ``random.Random(seed)``."""
    rng = random.Random(seed)
    taken: set[str] = set()
    names = _unique(rng, entities, 2, taken)
    regions = _unique(rng, 12, 2, taken)
    rivers = _unique(rng, 20, 1, taken)
    surnames = _unique(rng, 60, 2, taken)
    return [{"name": name, "founder": f"{rng.choice(_GIVEN)} {rng.choice(surnames)}",
             "year": rng.randint(1200, 1899), "region": rng.choice(regions), "river": rng.choice(rivers),
             "export": rng.choice(_EXPORTS)} for name in names]


def passages(ents: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Three passages per entity: founding, geography, trade."""
    out = []
    for i, e in enumerate(ents):
        n = e["name"]
        texts = (f"{n} is a small town. It was founded in {e['year']} by {e['founder']}, who built its first "
                 f"market hall.",
                 f"{n} lies in the {e['region']} region, on the banks of the {e['river']} river.",
                 f"The main export of {n} is {e['export']}, sold at its autumn fair.")
        out += [{"id": f"p{i:03d}-{k}", "title": n, "text": t} for k, t in enumerate(texts)]
    return out


_QUESTIONS = (("founder", "Who founded the town of {n}?"),
              ("year", "In which year was the town of {n} founded?"),
              ("region", "In which region does the town of {n} lie?"),
              ("river", "On which river does the town of {n} lie?"),
              ("export", "What is the main export of the town of {n}?"))


def questions(ents: list[dict[str, Any]], seed: int = SEED, train: int = TRAIN,
              eval_: int = EVAL) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(train, eval)`` question sets over distinct (entity, fact) pairs, shuffled by ``seed``."""
    rng = random.Random(seed + 1)
    pairs = [(i, k) for i in range(len(ents)) for k in range(len(_QUESTIONS))]
    rng.shuffle(pairs)
    rows = []
    for i, k in pairs[: train + eval_]:
        key, template = _QUESTIONS[k]
        rows.append({"id": f"q{i:03d}-{key}", "question": template.format(n=ents[i]["name"]),
                     "answer": str(ents[i][key])})
    return rows[:train], rows[train:]


def write(out: Path = DATA_DIR, seed: int = SEED) -> list[Path]:
    """Write ``corpus.jsonl``, ``train.jsonl`` and ``eval.jsonl`` under ``out``; returns their paths."""
    ents = generate(seed)
    train, ev = questions(ents, seed)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name, rows in (("corpus.jsonl", passages(ents)), ("train.jsonl", train), ("eval.jsonl", ev)):
        p = out / name
        p.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")
        files.append(p)
    return files


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Generate the search example's corpus and question sets.")
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    ap.add_argument("--seed", type=int, default=SEED)
    a = ap.parse_args(argv)
    for p in write(a.out, a.seed):
        print(p)


if __name__ == "__main__":
    main()
