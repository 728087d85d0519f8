"""The Global Resource Planner (Libra): how many GPUs train, how many roll out, and at which TP degrees.

- :mod:`.types`: workload, planner settings and plans.
- :mod:`.allocators`: the GRP and its baseline allocators behind one interface (chosen by name).
- :mod:`.search`: the split search between training and rollout ("Algorithm 1").
- :mod:`.rollout_dp`, :mod:`.buckets`, :mod:`.start_small`: the rollout dynamic programs; :mod:`.length_blind`:
  the rollout model of routers that ignore lengths.
- :mod:`.training`: the training layout decision tree.
- :mod:`.online`: online re-planning and the Elastic Hybrid Pool signal.

Cost models live in :mod:`libra.policies.cost`.
"""
