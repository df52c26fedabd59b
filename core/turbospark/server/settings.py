"""What one request may hold, as settings: bytes, a queue place, time.

Kept apart from :mod:`turbospark.server.limits` (which enforces them and needs
the web stack) so ``turbospark serve --help`` can show the defaults cheaply.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import uvicorn

MiB = 1024 * 1024
# The longest a queued prompt waits for requests still being prepared (Engine.expect):
# longer than templating a burst of chat prompts takes, shorter than the prefill
# forward a split burst costs its later half.
PREFILL_GATHER_S = 0.05


class ServerLimits(BaseModel):
    model_config = ConfigDict(frozen=True)

    max_request_bytes: int = Field(default=16 * MiB, gt=0)
    max_queue: int = Field(
        default=64, gt=0, description="generation requests admitted at once (running or waiting)"
    )
    request_timeout: float | None = Field(
        default=600.0, gt=0, description="seconds from a request's arrival to its last byte"
    )
    # A send may wait this long on a client that reads nothing (nginx's send_timeout
    # is 60 s too); past it the response is abandoned and its generation stops.
    send_timeout: float | None = Field(default=60.0, gt=0)
    # On SIGTERM, responses in flight get this long to end before they are
    # abandoned; then the warm sessions are written and the process exits.
    shutdown_grace: float = Field(default=5.0, ge=0)
    # A client gets this long to send its request headers (slowloris).
    header_timeout: float = Field(default=10.0, gt=0)
    # Idle keep-alive connections close after this (uvicorn's own default, made explicit).
    keep_alive_timeout: int = Field(default=5, gt=0)
    # h11 refuses request heads larger than this (its default is 16 KiB; a long
    # Authorization header plus cookies still fits in 64).
    max_header_bytes: int = Field(default=64 * 1024, gt=0)
    # Open connections plus running handlers; beyond it uvicorn answers 503
    # at once. Well above max_queue, so /health and refusals still get through.
    # From 7/8 of it, the connections idle longest are closed down to 3/4
    # (connections.py), so idle ones never lock real clients out.
    max_connections: int = Field(default=1024, ge=8)

    def uvicorn_config(self, app: Any, **kwargs: Any) -> uvicorn.Config:
        import uvicorn

        from turbospark.server.connections import GuardedH11

        protocol = functools.partial(
            GuardedH11,
            header_timeout=self.header_timeout,
            crowded=self.max_connections * 7 // 8,
            relieved=self.max_connections * 3 // 4,
        )
        return uvicorn.Config(
            app,
            http=protocol,
            timeout_keep_alive=self.keep_alive_timeout,
            timeout_graceful_shutdown=self.shutdown_grace,
            h11_max_incomplete_event_size=self.max_header_bytes,
            limit_concurrency=self.max_connections,
            **kwargs,
        )
