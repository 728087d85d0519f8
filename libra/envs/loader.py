"""Loading the environment a job's ``[env]`` table names, checked against :mod:`libra.envs.contract`.

``[env] entry`` (or ``name``) says which environment runs:

- an import path, ``"pkg.mod:Obj"`` (``Obj`` may be dotted: ``"pkg.mod:Outer.env"``) or ``"pkg.mod"`` (the
  module is the environment);
- a plain name: a bundled environment (:data:`BUNDLED`: ``arith``, ``single_turn``, ``openai_agent``), an
  entry point of the ``libra.envs`` group (``[project.entry-points."libra.envs"] my_env =
  "my_pkg.env:MyEnv"``), or else a top-level module of that name.

Whatever it names may be a module, an instance, or a class (instantiated once, with no arguments). With
neither key, a job that names a ``reward`` runs ``single_turn`` and any other runs ``arith``.

Every failure is a :class:`~libra.config.ConfigError` naming where (the job file, or ``episode env_config``
on a runner) and the key: an unknown name (the known ones listed), a module that cannot be imported (with
its error), a missing attribute, a class whose constructor raises, a missing required method (named),
a synchronous ``episode``, options the environment rejects (``[env.options] KEY: ...``), a reward function
that cannot be loaded. :func:`load_env_config` runs all of these checks; the job driver calls it before it
submits anything and every episode runner before its first episode.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from libra.config import ConfigError

from .contract import REQUIRED, OptionsError, Row

__all__ = ["BUNDLED", "GROUP", "env_key", "get_env", "load_env", "load_env_config", "load_reward",
           "problem_rows", "reward_outcome", "validate_options"]

GROUP = "libra.envs"
"""The entry-point group plug-ins register environments under."""
BUNDLED = {"arith": "libra.envs.arith", "single_turn": "libra.envs.single_turn",
           "openai_agent": "libra.envs.openai_agent"}
"""The environments shipped with Libra, by name (import paths)."""


def env_key(cfg: Any) -> tuple[str, str]:
    """``(key, spec)``: which ``[env]`` key names the environment and what it says (see the module doc)."""
    if getattr(cfg, "entry", ""):
        return "entry", cfg.entry
    if getattr(cfg, "name", ""):
        return "name", cfg.name
    return "name", "single_turn" if getattr(cfg, "reward", "") else "arith"


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def _import(target: str, at: str) -> Any:
    """The object at ``"pkg.mod:attr.attr"`` or the module ``"pkg.mod"``."""
    mod_name, _, attr = target.partition(":")
    if not mod_name or (":" in target and not attr):
        raise ConfigError(f"{at}: {target!r} is not an import path (write 'package.module:Object')")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as exc:  # noqa: BLE001  (the module's own error, whatever it is, is the message)
        raise ConfigError(f"{at}: cannot import module {mod_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split(".") if attr else ():
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{at}: module {mod_name!r} has no attribute {attr!r}") from None
    return obj


def load_env(spec: str, where: str = "job", key: str = "entry") -> Any:
    """The environment ``spec`` names (see the module docstring), checked for the required methods."""
    at = f"{where} [env] {key}"
    spec = spec.strip()
    if not spec:
        raise ConfigError(f"{at}: empty (name an environment: 'pkg.module:Object', an entry point or "
                          f"one of {', '.join(BUNDLED)})")
    if ":" in spec or "." in spec:
        obj = _import(spec, at)
    elif spec in BUNDLED:
        obj = _import(BUNDLED[spec], at)
    else:
        eps = _entry_points()
        if spec not in eps and importlib.util.find_spec(spec) is not None:  # a top-level module
            eps = {spec: None}
        if spec not in eps:
            known = sorted({*BUNDLED, *eps})
            raise ConfigError(f"{at}: unknown environment {spec!r}: not bundled and no {GROUP!r} entry point "
                              f"has that name (known: {', '.join(known)}; or give an import path "
                              "'package.module:Object')")
        try:
            obj = eps[spec].load() if eps[spec] is not None else importlib.import_module(spec)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"{at}: entry point {spec!r} ({getattr(eps[spec], 'value', spec)}) cannot be loaded: "
                              f"{type(exc).__name__}: {exc}") from exc
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"{at}: {spec!r} is a class and {obj.__name__}() raised "
                              f"{type(exc).__name__}: {exc}") from exc
    _check_methods(obj, spec, at)
    return obj


def _check_methods(env: Any, spec: str, at: str) -> None:
    missing = [m for m in REQUIRED if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"{at}: environment {spec!r} has no {', '.join(m + '()' for m in missing)} (an "
                          f"environment needs {' and '.join(REQUIRED)}; see libra.envs.contract)")
    ep = env.episode
    if not (inspect.iscoroutinefunction(ep) or inspect.iscoroutinefunction(getattr(ep, "__call__", None))):
        raise ConfigError(f"{at}: environment {spec!r} has a synchronous episode(); it must be "
                          "'async def episode(session, problem, cfg)'")
    for opt in ("validate_options", "make_problems", "to_row", "required_tools"):
        if hasattr(env, opt) and not callable(getattr(env, opt)):
            raise ConfigError(f"{at}: environment {spec!r} has a {opt} that is not callable")


def validate_options(env: Any, options: Mapping[str, Any], where: str = "job") -> dict[str, Any]:
    """The environment's ``validate_options(options)`` (see the contract); errors name the key."""
    at = f"{where} [env.options]"
    check = getattr(env, "validate_options", None)
    if check is None:
        if options:
            raise ConfigError(f"{at} {sorted(options)[0]}: this environment takes no options")
        return {}
    try:
        out = check(dict(options))
    except OptionsError as exc:
        raise ConfigError(f"{at} {exc.key}: {exc.message}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{at}: {exc}") from None
    if not isinstance(out, Mapping):
        raise ConfigError(f"{at}: validate_options returned {type(out).__name__}, not a mapping")
    try:
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{at}: validate_options returned options that are not JSON-able: {exc}") from None
    return dict(out)


def load_reward(spec: str, where: str = "job") -> Callable[..., Any]:
    """The reward function ``"pkg.mod:fn"`` of ``[env] reward`` (see the contract)."""
    at = f"{where} [env] reward"
    if ":" not in spec:
        raise ConfigError(f"{at}: {spec!r} is not an import path (write 'package.module:function')")
    fn = _import(spec, at)
    if not callable(fn):
        raise ConfigError(f"{at}: {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def load_env_config(cfg: Any, where: str = "job") -> tuple[Any, dict[str, Any]]:
    """``(environment, validated options)`` of an ``[env]`` table, every check done (module docstring)."""
    key, spec = env_key(cfg)
    env = load_env(spec, where, key)
    options = validate_options(env, getattr(cfg, "options", {}) or {}, where)
    if getattr(cfg, "reward", ""):
        load_reward(cfg.reward, where)
    elif getattr(env, "NEEDS_REWARD", False):
        raise ConfigError(f"{where} [env] reward: environment {spec!r} needs a reward function "
                          "(reward = 'package.module:function')")
    return env, options


def problem_rows(env: Any, n: int, seed: int, options: Mapping[str, Any], where: str = "job") -> list[Row]:
    """``n`` rows from the environment's own ``make_problems`` (a job without a ``[data]`` table)."""
    make = getattr(env, "make_problems", None)
    if make is None:
        raise ConfigError(f"{where} [env]: the environment has no make_problems(); give the job a [data] "
                          "table with its problems")
    try:
        problems = list(make(n, seed, **options))
        to_row = getattr(env, "to_row", None)
        rows = [to_row(p) if to_row is not None else p for p in problems]
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{where} [env]: make_problems/to_row failed: {type(exc).__name__}: {exc}") from None
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"{where} [env]: problem {i} is a {type(row).__name__}, not a row (a mapping); "
                              "give the environment a to_row()")
        try:
            json.dumps(row, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where} [env]: row {i} is not JSON-able: {exc}") from None
    if not rows:
        raise ConfigError(f"{where} [env]: make_problems({n}, {seed}) returned no problems")
    return [dict(r) for r in rows]


def reward_outcome(out: Any) -> tuple[float, dict[str, Any]]:
    """An ``episode`` (or reward function) result as ``(reward, info)``; raises ValueError when it is not a
    finite number or a ``(number, mapping)`` pair."""
    reward, info = (out if isinstance(out, tuple) and len(out) == 2 else (out, {}))
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"the reward must be a finite number (or a (reward, info) pair), got {out!r}"[:300])
    if not isinstance(info, Mapping):
        raise ValueError(f"the info must be a mapping, got {type(info).__name__}")
    return float(reward), dict(info)


def get_env(name: str) -> Any:
    """The environment called ``name`` (a bundled name, an entry point or an import path)."""
    return load_env(name, "get_env", "name")
