"""Every typed work payload, importable from one place (each lives in the module named for its work).

See :mod:`libra.protocol.payloads_base` for how payloads validate (``from_wire``) and travel (``to_wire``).
"""

from __future__ import annotations

from .payloads_base import Payload, PayloadError
from .payloads_job import EpisodeArgs, EpisodeResult, EpisodeSampling, EpisodeSpec, JobPollReply
from .payloads_refs import DataRef, WeightsRef
from .payloads_rollout import GenerateArgs, GenerateResult, OracleHints, RouteHints
from .payloads_tools import BashArgs, PytestArgs, PytestResult, PytestSummary, PythonArgs, ToolResult
from .payloads_train import TrainArgs, TrainPart, TrainResult

__all__ = [
    "BashArgs", "DataRef", "EpisodeArgs", "EpisodeResult", "EpisodeSampling", "EpisodeSpec", "GenerateArgs",
    "GenerateResult", "JobPollReply", "OracleHints", "Payload", "PayloadError", "PytestArgs", "PytestResult",
    "PytestSummary", "PythonArgs", "RouteHints", "ToolResult", "TrainArgs", "TrainPart", "TrainResult",
    "WeightsRef",
]
