"""The one configuration loader: TOML files → validated frozen dataclasses.

``load_section(path, section, cls)`` reads ``[section]`` of a TOML file (or the whole file when the
section is absent) into ``cls``; unknown keys and wrong types raise :class:`ConfigError` naming the
file, the key and what was expected. Validation is pydantic's, so ``"3"`` is not silently an int.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

import pydantic

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message says where and why."""


def from_mapping(cls: type[T], data: dict[str, Any], where: str = "config") -> T:
    """Validate ``data`` into dataclass ``cls`` (strict types, no unknown keys)."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    problems = []
    for key, value in data.items():
        try:
            values[key] = pydantic.TypeAdapter(hints[key]).validate_python(value, strict=True)
        except pydantic.ValidationError as exc:
            problems.append(f"{key}: {exc.errors()[0]['msg']} (got {value!r})")
    if problems:
        raise ConfigError(f"{where}: {'; '.join(problems)}")
    return cls(**values)


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from None


def load_section(path: str | Path, section: str, cls: type[T]) -> T:
    data = load_toml(path)
    body = data.get(section, data)
    if not isinstance(body, dict):
        raise ConfigError(f"{path}: [{section}] must be a table")
    return from_mapping(cls, body, f"{path} [{section}]")
