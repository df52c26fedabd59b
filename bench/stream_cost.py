"""The event loop's CPU time per streamed chunk, the engine taken out.

``bench/server_step.py`` measures the loop's CPU time per decode step beside a
real engine; on a 2-core CPU that number swings with whatever else runs. This
one isolates the per-chunk path: the app ``turbospark serve`` builds, on the
real uvicorn with ``serve``'s connection settings
(:class:`~turbospark.server.background.ThreadedServer`), with the engine's
``submit`` replaced by a fake engine thread that emits one chunk a row every
``step_ms`` (through the real bridge, queues, SSE rendering, middleware and
HTTP protocol), to N streaming chat clients in a subprocess (raw ``httpx``
streams, so their parsing never holds the server's GIL). The model is loaded
but never runs.

Reported: ``loop_us_per_chunk`` (the loop thread's own CPU-time clock over the
streaming, divided by the chunks sent), ``loop_cpu_ms_per_step`` (times the
N chunks of a step) and ``calls_per_chunk``, the Python calls the loop's
thread made a chunk, counted by ``cProfile`` over one more run: exact, where
the CPU time of a run swings by a fifth on a shared 2-core machine. With
``--burst K`` the fake engine emits K steps at once every ``K * step_ms``:
the loop then finds K chunks queued for each request, as it does whenever it
falls behind the engine; ``--top N`` lists the N functions called most.

The loop's CPU a step is a fixed part (waking the thread: about 0.2 ms on a
2-core CPU) and the chunks' own. There, at 16 clients, the path cost 137
Python calls and 52-57 us of CPU a chunk (64 clients: 136 calls, 42-49 us)
with an ``asyncio.timeout`` armed around every send, an ``asyncio.Queue`` get
per chunk and every body chunk through uvicorn's send and h11's state
machine; without them (``limits.SendDeadline``, ``bridge.Inbox``,
``GuardedH11.write_chunk``) 65 calls and 35-37 us (64 clients: 62 calls,
29-33 us), runs of each interleaved.

Run: ``uv run python bench/stream_cost.py --clients 16 [--burst 4] [--top 40]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
MODEL = "stream-cost"


class FakeEngine:
    """Emits a fixed text chunk to every submitted job each step, the last one
    finished (``length``) with stats, on its own thread, as the engine does."""

    def __init__(self, tokens: int, step_s: float, burst: int) -> None:
        from turbospark.generation.request import Chunk, GenerationStats

        self.tokens, self.step_s, self.burst = tokens, step_s, burst
        self.jobs: list[tuple[Any, list[int]]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.token = Chunk(text=" word", token=7)
        stats = GenerationStats(
            prompt_tokens=8,
            reused_tokens=0,
            generated_tokens=tokens,
            reuse_reason="fresh",
            reuse_detail="",
            swapped=False,
            evicted=False,
            prefill_seconds=0.0,
            decode_seconds=0.0,
        )
        self.last = Chunk(text="", finish_reason="length", stats=stats)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def submit(self, job: Any) -> None:
        with self.lock:
            self.jobs.append((job, [0]))

    def run(self) -> None:
        while not self.stop.wait(self.step_s * self.burst):
            with self.lock:
                jobs = list(self.jobs)
            for _ in range(self.burst):
                for job, sent in jobs:
                    if job.cancelled.is_set() or sent[0] > self.tokens:
                        continue
                    sent[0] += 1
                    job.emit(self.token if sent[0] <= self.tokens else self.last)
            with self.lock:
                self.jobs = [(j, s) for j, s in self.jobs if s[0] <= self.tokens]


def _stream(base: str, clients: int, tokens: int) -> dict[str, Any]:
    """*clients* concurrent streamed chats; the bytes each received (each
    stream's chunks must all arrive: a run that lost some would look cheap)."""
    got = [0] * clients
    barrier = threading.Barrier(clients)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "max_tokens": 100000,
    }

    def client(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            barrier.wait()
            with http.stream("POST", f"{base}/v1/chat/completions", json=body) as reply:
                reply.raise_for_status()
                for part in reply.iter_raw():
                    got[i] += len(part)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if min(got) < tokens * len(" word"):
        raise RuntimeError(f"a stream ended short: {got} bytes")
    return {"bytes": got}


def _counted(loop: asyncio.AbstractEventLoop, work: Callable[[], object]) -> cProfile.Profile:
    """``cProfile`` of the loop's thread over *work*: Python 3.11 profiles the
    thread that enables it (from 3.12 one profiler covers the process, and
    the fake engine's few calls join in). Its call counts are exact, so they
    compare two versions of the path where the CPU time of one run on a
    shared 2-core machine swings by a fifth; its times are inflated by the
    profiler and only rank. A stack sampler (``bench/thread_profile.py``)
    misleads here: it can only sample the loop's thread when that thread
    lets go of the GIL, in the socket's ``send`` or in ``epoll``, so the
    Python work before each write is charged to the write."""
    profiler = cProfile.Profile()
    switched = threading.Event()
    loop.call_soon_threadsafe(lambda: (profiler.enable(), switched.set()))
    switched.wait(10)
    try:
        work()
    finally:
        switched.clear()
        loop.call_soon_threadsafe(lambda: (profiler.disable(), switched.set()))
        switched.wait(10)
    return profiler


def measure(
    path: Path,
    clients: int,
    tokens: int,
    step_ms: float = 10.0,
    burst: int = 1,
    reps: int = 5,
    top: int = 0,
) -> dict[str, Any]:
    """Serve *path* with the fake engine; *reps* timed runs of *clients*
    streams of *tokens* chunks (and one before them, untimed), then one run
    under ``cProfile`` for the calls a chunk (and the *top* functions by calls)."""
    from turbospark.generation.runner import Runner
    from turbospark.server.app import create_app
    from turbospark.server.background import ThreadedServer
    from turbospark.server.worker import RunnerWorker
    from turbospark.text import load_text

    worker = RunnerWorker()
    runner = worker.run(lambda: Runner.open(path, context_length=512))
    app = create_app(runner, load_text(path), model_id=MODEL, worker=worker, max_batch=clients)
    fake = FakeEngine(tokens, step_ms / 1e3, burst)
    app.state.service.engine.submit = fake.submit
    chunks = clients * (tokens + 1)  # each stream's tokens and its finished chunk
    per_chunk: list[float] = []
    try:
        with ThreadedServer(app) as server:
            ident = server._thread.ident
            assert ident is not None
            clock = time.pthread_getcpuclockid(ident)
            spec = json.dumps({"base": server.base_url, "clients": clients, "tokens": tokens})
            drive = [sys.executable, "-m", "bench.stream_cost", "--drive", spec]

            def run() -> None:
                subprocess.run(drive, check=True, capture_output=True, cwd=ROOT, timeout=300)

            run()  # warm-up
            for _ in range(reps):
                cpu0 = time.clock_gettime(clock)
                run()
                per_chunk.append(1e6 * (time.clock_gettime(clock) - cpu0) / chunks)
            loop = app.state.service._loop_bridge.loop  # the server's, once a request streamed
            stats = pstats.Stats(_counted(loop, run))
    finally:
        fake.stop.set()
    calls = {
        f"{Path(file).name}:{line}:{name}": count
        for (file, line, name), (_, count, *_rest) in stats.stats.items()  # type: ignore[attr-defined]
    }
    median = statistics.median(per_chunk)
    return {
        "clients": clients,
        "tokens": tokens,
        "burst": burst,
        "loop_us_per_chunk": median,
        "loop_us_per_chunk_runs": [round(x, 1) for x in per_chunk],
        "loop_cpu_ms_per_step": median * clients / 1e3,
        "calls_per_chunk": sum(calls.values()) / chunks,
        "top_calls_per_chunk": [
            (name, round(count / chunks, 2))
            for name, count in sorted(calls.items(), key=lambda kv: -kv[1])[:top]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--burst", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--top", type=int, default=0, help="functions with the most calls")
    parser.add_argument("--drive", help=argparse.SUPPRESS)  # the clients' subprocess
    args = parser.parse_args()
    if args.drive:
        spec = json.loads(args.drive)
        json.dump(_stream(spec["base"], spec["clients"], spec["tokens"]), sys.stdout)
        return
    from bench.common import DEFAULT_CACHE, install

    path = install("gemma4", "chat_host", "float32", DEFAULT_CACHE)
    row = measure(path, args.clients, args.tokens, args.step_ms, args.burst, args.reps, args.top)
    print(json.dumps(row, indent=1 if args.top else None))


if __name__ == "__main__":
    main()
