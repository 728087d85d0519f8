"""An OpenAI-compatible endpoint for agent code, recording exact token ids for training.

Agent code written against the ``openai`` client runs against Libra: it points ``base_url`` at the endpoint
and passes its episode's trajectory id as the API key (or an ``X-Libra-Trajectory`` header, or
``extra_body={"trajectory": ...}``). Each ``/v1/chat/completions`` or ``/v1/completions`` request becomes one
model turn of that trajectory's :class:`~libra.rl.episode.EpisodeSession`, so it travels the broker's
``generate`` path and C-MLFQ routes every turn. The endpoint renders the model's chat template (with
``tools=``), parses tool calls out of the model's text into ``tool_calls`` (:mod:`.toolcalls`, pluggable),
streams when asked, and records the ids the model sampled with the engine's log-probs: training uses those
and never re-tokenizes text (the matching rule and what happens on edited history: :mod:`.trajectories`).

Where it runs: inside ``libra run`` through the environment adapter :mod:`libra.envs.openai_agent` (one
loopback endpoint per episode runner), or over a running cluster with ``libra serve``
(:mod:`libra.commands.serve`), which also opens and reads trajectories over HTTP.

Modules: ``messages`` (errors, normalization; pure), ``toolcalls`` (parsers), ``trajectories`` (the
registry and the matching rule), ``app`` (the Starlette routes), ``server`` (uvicorn on the sessions' loop).
"""

from __future__ import annotations

from .messages import EndpointError
from .server import EndpointServer, shared_endpoint
from .toolcalls import HermesToolParser, ParsedTurn, get_tool_parser
from .trajectories import TrajectoryRegistry

__all__ = ["EndpointError", "EndpointServer", "HermesToolParser", "ParsedTurn", "TrajectoryRegistry",
           "get_tool_parser", "shared_endpoint"]
