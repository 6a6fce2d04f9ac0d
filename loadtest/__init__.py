"""Locust load tests of a running tessera server: users over gRPC (the SDK) and REST (OpenAI
and Workers-AI routes), scenarios (short chat, agent sessions, long context, an abusive tenant)
and streaming metrics (time to first token, inter-token latency, tokens) as locust entries.
Run with `python3 -m locust -f loadtest/locustfile.py` (docs/operations.md, "Load tests")."""

from __future__ import annotations

from runtime.extras import require_extra

require_extra("load", "locust", "gevent", "geventhttpclient", what="loadtest/")

# isort: split
import locust  # noqa: E402, F401  (before other imports: it patches the standard library for gevent)

# isort: split
from grpc.experimental import gevent as grpc_gevent  # noqa: E402

# NOTE: after gevent's patching and before any channel exists, or gRPC calls block every user.
grpc_gevent.init_gevent()
