"""Pure policies, chosen by name: no sockets, clocks or logging. The broker and the simulator both call them.

- :mod:`.routing`: rollout routing — C-MLFQ, its prefix tree and the baseline routers (Libra).
- :mod:`.planner`: the Global Resource Planner — allocators, search, rollout DPs, online re-planning (Libra).
- :mod:`.cost`: the rollout and training cost models and their hardware/model profiles (Libra).
- :mod:`.actions`: action-level orchestration of tool and service calls (ARL-Tangram).
- :mod:`.parallelism`: the rollout parallelism selector and layout-aware data dispatch (EARL).
"""
