"""A sampling profiler of chosen threads, weighted by each thread's CPU time.

``bench/server_step.py`` used to enable one ``cProfile.Profile`` on the
runner thread and another on the event loop's thread. That works on Python
3.11, where a profiler hooks one thread; from 3.12 ``cProfile`` is built on
``sys.monitoring``, one tool for the whole process, so the second
``enable()`` raises ``ValueError: Another profiling tool is already active``.
Raised inside the engine's step, it failed every step before a request was
admitted, and the clients waited for replies that never came (the H200 run
on Python 3.12 hung that way). A single process-wide profiler would mix the
threads' call stacks.

This one reads the threads' stacks from another thread instead
(``sys._current_frames()``, every *interval* seconds) and charges each
sample with the CPU time the thread spent since the previous one
(``time.pthread_getcpuclockid``), so waits cost nothing and the threads stay
apart. A sample's key says which thread and, for a thread with a ``phase``
function, what it was doing (the runner: a prefill step or a decode step).
Python frames only: time in a C call (an MLX evaluation) is charged to the
Python function that made it, as ``cProfile`` does.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

Phase = Callable[[], str | None]


@dataclass
class _Watched:
    ident: int  # threading's ident (the pthread id)
    clock: int  # its CPU-time clock
    phase: Phase  # the key its samples go under now (None: not counted)
    last_cpu: float = 0.0


@dataclass
class Profile:
    """Per key: CPU seconds charged to each function as the innermost frame
    (``own``) and anywhere on the stack (``cumulative``), and sample counts."""

    own: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cumulative: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    samples: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def top(self, kind: str, n: int = 25) -> list[tuple[str, float, int]]:
        """``(function, CPU ms, samples)``, the *n* largest (*kind*: own or cumulative)."""
        table = self.own if kind == "own" else self.cumulative
        rows = sorted(table.items(), key=lambda kv: -kv[1])[:n]
        return [(name, round(1e3 * seconds, 1), self.samples[name]) for name, seconds in rows]


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{Path(code.co_filename).name}:{code.co_firstlineno}:{code.co_name}"


class ThreadSampler:
    """Samples the watched threads every *interval* seconds on a daemon thread
    of its own, between :meth:`start` and :meth:`stop`; :attr:`profiles` holds
    one :class:`Profile` per key."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.profiles: dict[str, Profile] = defaultdict(Profile)
        self._watched: list[_Watched] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, ident: int, phase: Phase) -> None:
        """Sample thread *ident*; *phase* () names the profile a sample goes to."""
        self._watched.append(_Watched(ident, time.pthread_getcpuclockid(ident), phase))

    def start(self) -> None:
        for w in self._watched:
            w.last_cpu = time.clock_gettime(w.clock)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """One sample of every watched thread (a thread that ended is skipped)."""
        frames = sys._current_frames()
        for w in self._watched:
            frame = frames.get(w.ident)
            try:
                cpu = time.clock_gettime(w.clock)
            except OSError:  # the thread ended
                continue
            spent, w.last_cpu = cpu - w.last_cpu, cpu
            key = w.phase()
            if frame is None or key is None or spent <= 0:
                continue
            profile = self.profiles[key]
            seen: set[str] = set()
            inner = True
            while frame is not None:
                name = _where(frame)
                if inner:
                    profile.own[name] += spent
                    inner = False
                if name not in seen:  # recursion counts once
                    seen.add(name)
                    profile.cumulative[name] += spent
                    profile.samples[name] += 1
                frame = frame.f_back
