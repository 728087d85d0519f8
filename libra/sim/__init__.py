"""Discrete-event simulator and workload generators for agentic-RL rollouts.

``trace`` is the trajectory trace format (the JSON Lines contract of ``docs/trace-format.md``);
``workloads`` holds the seeded, calibrated generators that write it (parameters in
``workload_profiles``, calibration facts in ``workload_stats`` / ``workload_routing``). Nothing here
opens sockets or reads clocks.
"""
