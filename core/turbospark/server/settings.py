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


class ServerLimits(BaseModel):
    model_config = ConfigDict(frozen=True)

    max_request_bytes: int = Field(default=16 * MiB, gt=0)
    max_queue: int = Field(
        default=64, gt=0, description="generation requests admitted at once (running or waiting)"
    )
    request_timeout: float | None = Field(
        default=600.0, gt=0, description="seconds from a request's arrival to its last byte"
    )
    # A client gets this long to send its request headers (slowloris).
    header_timeout: float = Field(default=10.0, gt=0)
    # Idle keep-alive connections close after this (uvicorn's own default, made explicit).
    keep_alive_timeout: int = Field(default=5, gt=0)
    # h11 refuses request heads larger than this (its default is 16 KiB; a long
    # Authorization header plus cookies still fits in 64).
    max_header_bytes: int = Field(default=64 * 1024, gt=0)
    # Open connections plus running handlers; beyond it uvicorn answers 503
    # at once. Well above max_queue, so /health and refusals still get through.
    max_connections: int = Field(default=1024, gt=0)

    def uvicorn_config(self, app: Any, **kwargs: Any) -> uvicorn.Config:
        import uvicorn

        from turbospark.server.limits import HeaderTimeoutH11

        return uvicorn.Config(
            app,
            http=functools.partial(HeaderTimeoutH11, header_timeout=self.header_timeout),
            timeout_keep_alive=self.keep_alive_timeout,
            h11_max_incomplete_event_size=self.max_header_bytes,
            limit_concurrency=self.max_connections,
            **kwargs,
        )
