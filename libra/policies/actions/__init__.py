"""Action-level orchestration (ARL-Tangram): which tool and service calls start, with how many cores or GPUs.

- :mod:`.registry`: the public surface (``make_action_scheduler`` by name).
- :mod:`.model`, :mod:`.views`: the unified action model and the indexed views a scheduler sees.
- :mod:`.tangram`, :mod:`.tangram_evict`, :mod:`.estimate`, :mod:`.split`: the elastic scheduler and its pieces.
- :mod:`.baselines`: ``fixed_dop`` and ``per_trajectory``.
- :mod:`.gpu_cells`, :mod:`.gpu_services`: topology-aware GPU cells and evict-on-execution GPU services.
"""
