"""Chunks from the engine's thread to the requests' queues on the event loop.

The engine emits one chunk per row per step. Scheduling each one with
``loop.call_soon_threadsafe`` costs a write to the loop's wake-up pipe and a
loop iteration per chunk, on the thread that also needs the GIL to build the
next step; a step of 16 rows made 16 of them. A :class:`LoopBridge` buffers
what the engine hands over and wakes the loop once for everything buffered
since its last wake-up, so a step costs one wake-up whatever its rows. Order
is kept: items reach their queues in the order they were put.

A request takes its items from an :class:`Inbox`: all that arrived since it
last looked, in one call, where an ``asyncio.Queue`` costs a ``get`` (and
its bookkeeping: unfinished-task counts, an event, a future per empty wait)
per item; on a host-bound GPU the event loop's time per streamed chunk is time
the next decode step waits for the GIL.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class Sink(Protocol):
    def put_nowait(self, item: Any, /) -> None: ...


class Inbox(Generic[T]):
    """Items for one consumer on the event loop: :meth:`put_nowait` from the
    loop's thread (the bridge's drain, a timer), :meth:`take` waits for at
    least one and returns every item there, oldest first."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[T]:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


class LoopBridge:
    """Puts items on queues (an :class:`Inbox`, an ``asyncio.Queue``) of one
    event loop from any thread, one wake-up per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Sink, Any]] = []
        self._scheduled = False

    def put(self, queue: Sink, item: Any) -> None:
        """Hand *item* to *queue* (on the loop's thread, soon)."""
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return  # the wake-up already on its way takes this one too
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)
