"""Rollout routing (Libra): which rollout instance runs each generate turn.

- :mod:`.interface`: the ``Router`` protocol, bucket specs, snapshots, decisions and placement helpers.
- :mod:`.sticky`: the shared per-trajectory machinery (stickiness, placement, migration mode).
- :mod:`.cmlfq`, :mod:`.cmlfq_cost`: C-MLFQ and its distribution- and cost-based variant.
- :mod:`.prefix_tree`, :mod:`.tool_state`: C-MLFQ's causal prefix tree and the tool-return states that key it
  (the tree's nodes in :mod:`.prefix_tree_nodes`, its saved form in :mod:`.prefix_tree_io`).
- :mod:`.baselines`: the baseline routers and the registry (``make_router`` by name).
"""
