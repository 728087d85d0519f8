"""Transport and security shared by every process: endpoints (and the per-user ipc path), frame send/receive,
CurveZMQ and its key files, systemd readiness notification."""
