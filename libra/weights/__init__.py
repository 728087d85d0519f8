"""Weights: how a trainer's weights reach the rollout engines, in one package.

Modules (import them directly; this package's ``__init__`` imports nothing, so that the data plane, which
carries the :mod:`.format` stream for other objects too, can import it without a cycle):

- :mod:`.format`: a state dict as a msgpack header plus raw, CRC-checked byte chunks, and back (no pickle).
  The data plane serves these streams; training shards and KV contexts use the same format.
- :mod:`.file`: one version as a single file (the format's header and chunks), for weights on shared
  storage: the documented fallback of a weights ref with a ``path``.
- :mod:`.packed`: a received stream kept as its verified chunks, a lazy state dict that decodes straight
  into a rollout model's own tensors (one copy, tied weights once).
- :mod:`.transport`: the weights-transport interface (``WeightPublisher.publish(version, state_dict) ->
  ref`` on the trainer, ``WeightFetcher.fetch(ref) -> (state_dict, version, stats)`` on a rollout) and the
  one choice of transport (``TRANSPORTS``; ``make_publisher`` from ``$LIBRA_WEIGHTS_TRANSPORT``, a
  rollout's fetcher from the ref's ``transport``).
- :mod:`.dataplane`: the ZeroMQ data-plane implementation, the default, with delta sync: the trainer also
  serves ``weights/v{N}/from/v{M}`` (:mod:`.delta`, the codec: unchanged tensors skipped, changed ones as a
  bitmap, delta-coded positions or dense, each checked by a CRC-32 of its result) and a rollout slot that
  holds ``v{M}`` in host memory (:mod:`.host_copy`) fetches only that.
- :mod:`.torch_dist`: the ``torch.distributed`` implementation (``[actors] weights_transport = "torch"``):
  gloo, NCCL between two GPUs, or a CUDA IPC copy on one GPU, over pair groups kept per peer
  (:mod:`.pairs`) and IPC handles keyed by device UUID (:mod:`.cuda_ipc`).
- :mod:`.backend`: the pure choice among those three paths, from where the two ends' tensors live, and
  the bucket plan of a broadcast.
"""
