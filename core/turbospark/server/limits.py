"""Bounds on what one client can make the server hold: bytes, queue places, time.

* :class:`ServerLimits` -- the knobs (``turbospark serve --max-request-bytes
  --max-queue --request-timeout``) and the uvicorn settings derived from them.
* :func:`read_body` -- the body, refused with 413 as soon as it is known to be
  too large: from ``Content-Length`` before reading anything, else while
  counting a chunked upload.
* :class:`Admission` -- at most ``max_queue`` generation requests waiting for or
  using the runner; the next gets 503 with ``Retry-After``.
* :class:`Deadline` -- one per request, from its first byte to its last.
* :class:`HeaderTimeoutH11` -- uvicorn's h11 protocol plus a deadline on request
  headers: uvicorn times out idle keep-alive connections but not a client that
  connects and then sends its headers one byte at a time (any byte cancels
  its keep-alive timer).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import h11
from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from turbospark.server.errors import APIError

MiB = 1 << 20


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes; send a "
        "shorter prompt or serve with a larger --max-request-bytes",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 without reading past *limit* bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client closed the connection while sending the body") from None
    return b"".join(chunks)


class Deadline:
    """``--request-timeout`` for one request; ``None`` means no deadline."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.end = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    @property
    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end

    def error(self, during: str, status: int = 504) -> APIError:
        return APIError(
            status,
            f"the request ran past this server's --request-timeout of {self.seconds:g} s "
            f"{during}; ask for fewer tokens, retry later, or serve with a larger timeout",
            code="request_timeout",
        )

    async def run(self, awaitable: Any, during: str, status: int = 504) -> Any:
        """Await *awaitable* within the deadline (an :class:`APIError` past it:
        408 when the client was too slow sending, 504 when the server was)."""
        try:
            async with asyncio.timeout(self.remaining()):
                return await awaitable
        except TimeoutError:
            raise self.error(during, status) from None


class Admission:
    """A bounded count of generation requests, kept on the event loop (no lock).

    ``Retry-After`` is the time the requests ahead need at the recent pace: the
    count times a moving average of how long an admitted request stayed.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.active = 0
        self.admitted = 0
        self.refused = 0
        self._mean_seconds = 1.0

    def admit(self) -> Ticket:
        if self.active >= self.capacity:
            self.refused += 1
            wait = max(1, math.ceil(self.active * self._mean_seconds))
            raise APIError(
                503,
                f"the server is busy: {self.active} requests are already queued (--max-queue "
                f"{self.capacity}); retry after {wait} s",
                code="queue_full",
                headers={"Retry-After": str(wait)},
            )
        self.active += 1
        self.admitted += 1
        return Ticket(self)

    def _leave(self, seconds: float) -> None:
        self.active -= 1
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * seconds


class Ticket:
    """One admitted request's place; :meth:`release` is idempotent."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission
        self._since = time.monotonic()

    def release(self) -> None:
        if self._admission is not None:
            self._admission._leave(time.monotonic() - self._since)
            self._admission = None

    def hand_over(self) -> Ticket:
        """The place, moved to a new owner (a streaming response): leaving this
        ticket's ``with`` block then releases nothing."""
        other = Ticket(self._admission) if self._admission is not None else self
        other._since = self._since
        self._admission = None
        return other

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class HeaderTimeoutH11(H11Protocol):
    """Closes a connection whose request headers are not complete within
    ``header_timeout`` seconds of the connection opening or of the previous
    response ending (the body is under the request's own deadline)."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)
