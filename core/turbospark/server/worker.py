"""The one thread that touches the runner, and the bridge from it to asyncio.

A runner is a single mutable conversation store, so requests must run one at
a time. They are serialised by submitting all MLX work to a single-thread
executor rather than by an ``asyncio.Lock`` held around an await: a lock is
released as soon as a cancelled handler unwinds (a client hanging up) while
its thread may still be feeding the runner, whereas the executor cannot start
the next request before the previous one's work has returned. The event loop
only ever waits on futures, so it keeps serving ``/health`` and new requests.

MLX binds a lazy array to a stream of the thread that built it, and another
thread cannot evaluate it ("There is no Stream(cpu, 0) in current thread").
So the best place to open a runner is this same thread (:meth:`RunnerWorker.run`),
which is what ``turbospark serve`` does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_END = object()


class RunnerWorker:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turbospark-runner")

    def run(self, fn: Callable[[], T]) -> T:
        """Run *fn* on the runner thread and wait (e.g. ``Runner.open`` before serving)."""
        return self._executor.submit(fn).result()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run *fn* on the runner thread after every earlier request has finished."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def stream(self, start: Callable[[], Generator[T, None, None]]) -> AsyncIterator[T]:
        """Iterate ``start()`` on the runner thread, delivering items to the loop.

        When the consumer stops early (the async generator is closed or
        cancelled because the client disconnected), the thread closes the
        sync generator at its next item: generation stops between two
        finished steps, so the runner's state and record stay in agreement.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancelled = threading.Event()

        def put(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                items = start()
                try:
                    for item in items:
                        put(item)
                        if cancelled.is_set():
                            break
                finally:
                    items.close()
            except Exception as exc:  # delivered to the consumer, which reports it
                put(exc)
            finally:
                put(_END)

        loop.run_in_executor(self._executor, work)
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield item  # an item of start()'s iterator
        finally:
            cancelled.set()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
