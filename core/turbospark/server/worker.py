"""The one thread that touches the runner.

MLX binds a lazy array to a stream of the thread that built it, and another
thread cannot evaluate it ("There is no Stream(cpu, 0) in current thread").
So a runner is opened on this thread (:meth:`RunnerWorker.run`, which is what
``turbospark serve`` does) and the engine's loop (:mod:`turbospark.generation.engine`)
then runs here for the server's lifetime; requests reach it through
:class:`turbospark.generation.engine.Job` and never touch MLX on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class RunnerWorker:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turbospark-runner")

    def run(self, fn: Callable[[], T]) -> T:
        """Run *fn* on the runner thread and wait (e.g. ``Runner.open`` before serving)."""
        return self._executor.submit(fn).result()

    def submit(self, fn: Callable[[], object]) -> None:
        """Start *fn* on the runner thread without waiting (the engine's loop)."""
        self._executor.submit(fn)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
