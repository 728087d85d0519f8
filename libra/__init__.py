"""Libra: a resource manager and runtime for agentic RL post-training of LLMs.

Every GPU and CPU slot is an actor that bids for rollout, training or action work from a ZeroMQ
broker. See README.md for how to run it and ``libra/protocol`` for the wire contract.
"""

__version__ = "0.1.0"
