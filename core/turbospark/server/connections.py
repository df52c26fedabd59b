"""What one connection may hold: time to send its headers, a place among the
server's connections while it sends nothing, and a response nobody reads.

:class:`GuardedH11` is uvicorn's h11 protocol with three bounds uvicorn lacks:

* **headers**: a connection whose request headers are not complete within
  ``header_timeout`` of opening (or of the previous response) is closed.
  uvicorn times out idle keep-alive connections, but any byte cancels that
  timer, so a client sending its headers a byte at a time held a place forever.
* **idle places under pressure**: uvicorn answers 503 to every request once its
  open connections reach ``limit_concurrency``, idle ones included, so a crowd
  of idle or half-open connections locked real clients out until they timed
  out. When a new connection brings the count to ``crowded``, the connections
  idle longest (no request in flight) are closed until ``relieved`` remain;
  a client with a request in flight is never closed for it.
* **a stalled reader**: :func:`abandon` aborts the connection a request came
  on (its unsent bytes dropped), which ``limits.SendDeadline`` does when a
  send waits on a client that reads nothing (:func:`drained` makes a reply's
  last send wait until its bytes are taken). ``transport.close()`` would wait
  for those bytes to drain, which a stalled client never lets happen; so an
  idle connection closed under pressure with a reply still unread is aborted.

It also writes a streamed reply's body chunks itself when the socket can take
them at once (:meth:`GuardedH11.write_chunk`, which ``limits.SendDeadline``
tries first): the bytes uvicorn would write, without the twenty-odd Python
calls a chunk that uvicorn's send and h11's state machine cost the event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

import h11
from h11._writers import ChunkedWriter
from starlette.types import Scope
from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol plus the bounds above (one instance a connection)."""

    # Every open connection of every server in this process, by (server, client)
    # address: the pair is unique while both ends are open.
    _open: ClassVar[dict[tuple[Any, Any], GuardedH11]] = {}

    def __init__(
        self, *args: Any, header_timeout: float, crowded: int, relieved: int, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.crowded = crowded
        self.relieved = relieved
        self.idle_since = time.monotonic()
        self._header_timer: asyncio.TimerHandle | None = None

    @property
    def idle(self) -> bool:
        """No request in flight: between requests, or its headers not yet complete."""
        return (self.cycle is None or self.cycle.response_complete) and (
            self.conn.their_state is h11.IDLE
        )

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
        GuardedH11._open[(self.server, self.client)] = self
        self._arm()
        if len(self.connections) >= self.crowded:
            self._make_room()

    def _make_room(self) -> None:
        """Close the connections idle longest until ``relieved`` remain open (or
        none idle is left); this new one is the most recent, so it stays."""
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11)]
        idle = sorted((c for c in idle if c.idle), key=lambda c: c.idle_since)
        for connection in idle[: max(0, len(self.connections) - self.relieved)]:
            if connection.transport.get_write_buffer_size():
                connection.transport.abort()  # a reply its client never took: close() would wait
            else:
                connection.timeout_keep_alive_handler()  # uvicorn's own close of an idle one

    def write_chunk(self, scope: Scope, body: bytes) -> bool:
        """Write *body* as the next chunk of *scope*'s chunked response if it can go
        at once, the bytes uvicorn's send would write (h11's chunked framing);
        False, writing nothing, where uvicorn's send must decide: a send that
        would wait (the transport paused), a response not started, complete or
        not chunked (HTTP/1.0, HEAD), a client gone, an empty body.

        A streamed reply sends one body message per engine step, and uvicorn's
        send runs each through h11's state machine (which a body chunk never
        moves) at about twenty Python calls, on the event loop's thread, whose
        time a host-bound decode step waits for (``bench/stream_cost.py``)."""
        cycle = self.cycle
        if (
            not body
            or cycle is None
            or cycle.scope is not scope
            or not cycle.response_started
            or cycle.response_complete
            or cycle.disconnected
            or self.flow.write_paused
            or self.conn.our_state is not h11.SEND_BODY
            or type(self.conn._writer) is not ChunkedWriter
        ):
            return False
        self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.idle_since = time.monotonic()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        GuardedH11._open.pop((self.server, self.client), None)
        super().connection_lost(exc)


def abandon(scope: Scope) -> bool:
    """Abort the connection *scope*'s request came on, dropping what it has not
    sent; False if it is gone already (or was not served by :class:`GuardedH11`)."""
    connection = _connection(scope)
    if connection is None:
        return False
    connection.transport.abort()
    return True


async def drained(scope: Scope) -> None:
    """Wait until the client of *scope*'s connection has taken what was written,
    down to the transport's low-water mark (uvicorn's own flow control). A body
    is written whole, so the send that writes it never waits by itself."""
    connection = _connection(scope)
    if connection is not None and connection.flow is not None:
        await connection.flow.drain()


def connection_of(scope: Scope) -> GuardedH11 | None:
    """The connection *scope*'s request came on (None once it is gone, or when
    :class:`GuardedH11` did not serve it)."""
    return _connection(scope)


def _connection(scope: Scope) -> GuardedH11 | None:
    return GuardedH11._open.get((scope.get("server"), scope.get("client")))
