"""The serving owner's own serving process: ``python -m libra.serving``.

A lendable slot whose GPU belongs to a serving owner lends while that owner's latency has headroom
(:class:`~libra.actors.owners.ServingLoadOwner`). This package is that owner, for real: a local OpenAI-style
endpoint (``/v1/completions``, ``/v1/chat/completions``) serving its own model with the HF engine directly
(not through the broker; compare :mod:`libra.serve`, the endpoint for agent code over the broker), batching
waiting requests as the engine allows (:mod:`.batcher`), and ``GET /load``: p50/p99 time per output token and
p99 time to first token over a sliding window of finished requests (:mod:`.window`). The load generator that
drives it is :mod:`libra.bench.serving_load`. Contract and figures: ``docs/lending.md`` ("Owners").

Modules: ``window`` (the reading; pure), ``batcher`` (the engine thread), ``app`` (the Starlette routes),
``__main__`` (the command).
"""
