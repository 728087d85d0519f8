"""The tool-execution sandbox (ARL-Tangram's CPU manager on one host).

- :mod:`.pool`: ``SandboxPool``, the warm pool of isolated sandboxes that runs tool calls.
- :mod:`.slot` (one sandbox and its zygote start), :mod:`.pool_isolation` (the pool's isolation mode and report).
- :mod:`.tools`: the built-in tools (``python``, ``bash``, ``pytest``): argument validation and commands.
- :mod:`.handlers`: those tools as actor work handlers (``sandbox_tools``).
- :mod:`.errors`: limits, results and the typed errors; :mod:`.outcome` turns a raw exit into one.
- :mod:`.isolation` (bubblewrap arguments), :mod:`.proc` (zygote processes), :mod:`.zygote` (the zygote
  itself, run inside the sandbox), :mod:`.cgroup` (cgroup v2 quotas), :mod:`.cores` (core and NUMA pinning).
"""
