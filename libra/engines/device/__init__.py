"""Where an actor's engines run, by kind: placement (device, dtype, memory budget: ``placement``), slot
names (``slots``), dtype names (``dtypes``), tensor-parallel groups and engine labels (``tp_groups``), CUDA
discovery and out-of-memory helpers (``cuda``), and their errors (``errors``)."""
