"""Engines: the code that does the work an actor accepts (rollout, training, tool actions, services).

Each engine lives in its own module and is imported by name; this package imports nothing so that a CPU
tool actor never pulls in torch. The tool-execution sandbox is the :mod:`libra.engines.sandbox` package.
"""
