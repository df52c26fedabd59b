"""Bounds on what one client can make the server hold: bytes, queue places, time.

* :class:`ServerLimits` (``settings.py``) -- the knobs (``turbospark serve
  --max-request-bytes --max-queue --request-timeout --send-timeout``).
* :func:`read_body` -- the body, refused with 413 as soon as it is known to be
  too large: from ``Content-Length`` before reading anything, else while
  counting a chunked upload.
* :class:`Admission` -- at most ``max_queue`` generation requests waiting for or
  using the runner; the next gets 503 with ``Retry-After``.
* :class:`Deadline` -- one per request, from its first byte to its last.
* :class:`SendDeadline` -- the middleware that starts each request's deadline
  and holds every send to it: a response whose client stops reading ends
  there, or after ``send_timeout`` of waiting, whichever is first.

What a connection may hold (its headers' time, an idle place) is bounded in
``connections.py``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turbospark.server.connections import abandon, connection_of, drained
from turbospark.server.errors import APIError

MiB = 1 << 20
DEADLINE_KEY = "turbospark.deadline"  # where SendDeadline leaves the request's Deadline

log = logging.getLogger("turbospark.server")


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


class ClientStalled(Exception):
    """A send waited on a client that reads nothing, past its bound."""


class SendDeadline:
    """Every HTTP response ends by its request's deadline, whatever the client does.

    A send waits only while the client's socket is full, that is while the
    client reads nothing; the check inside a streamed response's generator
    never runs then. So each send is bounded here: by the deadline, and by
    ``send_timeout`` of waiting. Past either, the connection is aborted and the
    response abandoned; its stream's generator is closed (``EventStream``), so
    the generation stops and its queue place and session are given back. The
    request's :class:`Deadline` starts here and is the one its handler keeps
    (``scope[DEADLINE_KEY]``), so both agree on when it ends.
    """

    def __init__(
        self, app: ASGIApp, request_timeout: float | None, send_timeout: float | None
    ) -> None:
        self.app = app
        self.request_timeout = request_timeout
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = scope[DEADLINE_KEY] = Deadline(self.request_timeout)
        connection = connection_of(scope)
        flow = None if connection is None else connection.flow

        async def within(wait: Awaitable[None]) -> None:
            bounds = [b for b in (self.send_timeout, deadline.remaining()) if b is not None]
            try:
                async with asyncio.timeout(min(bounds, default=None)):
                    await wait
            except TimeoutError:
                why = "past its --request-timeout" if deadline.expired else "past --send-timeout"
                raise ClientStalled(why) from None

        async def bounded(message: Message) -> None:
            if (
                connection is not None
                and message["type"] == "http.response.body"
                and message.get("more_body")
                and connection.write_chunk(scope, message.get("body", b""))
            ):
                return  # a streamed chunk, written at once
            if flow is None or flow.write_paused:
                await within(send(message))  # it waits until the client takes some bytes
            else:  # the transport takes it at once: nothing to bound, no timer to arm
                await send(message)
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if last and (flow is None or flow.write_paused):
                await within(drained(scope))  # a reply ends when its client has taken it

        try:
            await self.app(scope, receive, bounded)
        except ClientStalled as exc:
            await _abandon(scope, f"the client read nothing while a send waited {exc}")
        except asyncio.CancelledError:  # the server is stopping, and its grace is over
            task = asyncio.current_task()
            if task is None or task.uncancel() > 0:  # a cancel that was not only that one
                raise
            await _abandon(scope, "the server stopped before the response ended")


async def _abandon(scope: Scope, why: str) -> None:
    """Abort the request's connection, one log line; then yield once, so uvicorn
    has seen the connection go before the app returns (it would log an
    unfinished response otherwise)."""
    if abandon(scope):
        log.warning("%s %s: %s; the response was abandoned", scope["method"], scope["path"], why)
        await asyncio.sleep(0)
