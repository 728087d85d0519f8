"""The broker: ``BrokerState`` (pure core) and the ZeroMQ ROUTER shell in ``server``."""

from __future__ import annotations

from .state import BrokerConfig, BrokerState

__all__ = ["BrokerConfig", "BrokerState"]
