"""Chunks from the engine's thread to the requests' queues on the event loop.

The engine emits one chunk per row per step. Scheduling each one with
``loop.call_soon_threadsafe`` costs a write to the loop's wake-up pipe and a
loop iteration per chunk, on the thread that also needs the GIL to build the
next step; a step of 16 rows made 16 of them. A :class:`LoopBridge` buffers
what the engine hands over and wakes the loop once for everything buffered
since its last wake-up, so a step costs one wake-up whatever its rows. Order
is kept: items reach their queues in the order they were put.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class LoopBridge:
    """Puts items on asyncio queues of one event loop from any thread, one wake-up per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []
        self._scheduled = False

    def put(self, queue: asyncio.Queue[Any], item: Any) -> None:
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
