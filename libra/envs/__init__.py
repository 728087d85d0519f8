"""Environments: the public contract (:mod:`libra.envs.contract`), the loader of plug-ins
(:mod:`libra.envs.loader`: an import path, a ``libra.envs`` entry point or a bundled name) and the bundled
environments, :mod:`libra.envs.arith` (multi-turn tool use) and :mod:`libra.envs.single_turn` (a dataset's
prompt and a reward function). ``get_env(name)`` returns the environment a name or path names."""

from __future__ import annotations

from .loader import get_env, load_env, load_env_config

__all__ = ["get_env", "load_env", "load_env_config"]
