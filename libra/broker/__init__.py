"""The broker: the pure core ``state.BrokerState`` (its components in ``sessions``, ``work_table``,
``dispatch``, ``rollout``, ``actions``, ``job_board``, ``plan_rounds``) and the ZeroMQ ROUTER shell in ``server``.

The package imports nothing: import what you need from its modules (``from libra.broker.state import
BrokerConfig, BrokerState``).
"""
