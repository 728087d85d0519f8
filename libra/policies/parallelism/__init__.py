"""EARL: the rollout parallelism selector (:mod:`.selector`) and layout-aware data dispatch (:mod:`.dispatch`)."""
