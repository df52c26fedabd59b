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
streaming, divided by the chunks sent) and ``loop_cpu_ms_per_step`` (times the
N chunks of a step). With ``--burst K`` the fake engine emits K steps at once
every ``K * step_ms``: the loop then finds K chunks queued for each request,
as it does whenever it falls behind the engine.

Run: ``uv run python bench/stream_cost.py --clients 16``.
"""

from __future__ import annotations

import argparse
import json
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


def _stream(base: str, clients: int) -> dict[str, Any]:
    """*clients* concurrent streamed chats; the bytes each received."""
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
    return {"bytes": got}


def _ticks(native_id: int) -> tuple[int, int]:
    """The thread's user and system CPU time so far, in clock ticks (``/proc``)."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)


def _profiled(ident: int, work: Callable[[], object]) -> str:
    """Stack samples of the loop's thread over *work*, each charged with the
    thread's CPU time since the last (:class:`bench.thread_profile.ThreadSampler`):
    the functions with the most CPU time, own and cumulative."""
    from bench.thread_profile import ThreadSampler

    sampler = ThreadSampler(interval=0.0005)
    sampler.watch(ident, lambda: "loop")
    sampler.start()
    try:
        work()
    finally:
        sampler.stop()
    profile = sampler.profiles["loop"]
    lines = []
    for kind in ("own", "cumulative"):
        lines.append(f"{kind} CPU ms (samples):")
        lines += [f"  {ms:8.1f} ({n:5d})  {name}" for name, ms, n in profile.top(kind, 30)]
    return "\n".join(lines)


def measure(
    clients: int, tokens: int, step_ms: float, burst: int, reps: int, profile: bool = False
) -> dict[str, Any]:
    from bench.common import DEFAULT_CACHE, install
    from turbospark.generation.runner import Runner
    from turbospark.server.app import create_app
    from turbospark.server.background import ThreadedServer
    from turbospark.server.worker import RunnerWorker
    from turbospark.text import load_text

    path = install("gemma4", "chat_host", "float32", DEFAULT_CACHE)
    worker = RunnerWorker()
    runner = worker.run(lambda: Runner.open(path, context_length=512))
    app = create_app(runner, load_text(path), model_id=MODEL, worker=worker, max_batch=clients)
    fake = FakeEngine(tokens, step_ms / 1e3, burst)
    app.state.service.engine.submit = fake.submit
    per_chunk: list[float] = []
    kernel: list[float] = []
    profiled = ""
    with ThreadedServer(app) as server:
        ident = server._thread.ident
        assert ident is not None
        clock = time.pthread_getcpuclockid(ident)
        spec = json.dumps({"base": server.base_url, "clients": clients})
        drive = [sys.executable, "-m", "bench.stream_cost", "--drive", spec]
        subprocess.run(drive, check=True, capture_output=True, cwd=ROOT)  # warm-up
        native = server._thread.native_id
        for _ in range(reps):
            cpu0, ticks0 = time.clock_gettime(clock), _ticks(native)
            subprocess.run(drive, check=True, capture_output=True, cwd=ROOT)
            cpu, ticks = time.clock_gettime(clock) - cpu0, _ticks(native)
            per_chunk.append(1e6 * cpu / (clients * (tokens + 1)))
            user, system = ticks[0] - ticks0[0], ticks[1] - ticks0[1]
            kernel.append(system / max(1, user + system))
        if profile:
            profiled = _profiled(ident, lambda: subprocess.run(drive, check=True, cwd=ROOT))
    fake.stop.set()
    if profiled:
        print(profiled, file=sys.stderr)
    median = statistics.median(per_chunk)
    return {
        "clients": clients,
        "tokens": tokens,
        "burst": burst,
        "loop_us_per_chunk": median,
        "loop_us_per_chunk_runs": [round(x, 1) for x in per_chunk],
        "loop_cpu_ms_per_step": median * clients / 1e3,
        "loop_kernel_share": round(statistics.median(kernel), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--burst", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the loop's thread")
    parser.add_argument("--drive", help=argparse.SUPPRESS)  # the clients' subprocess
    args = parser.parse_args()
    if args.drive:
        spec = json.loads(args.drive)
        json.dump(_stream(spec["base"], spec["clients"]), sys.stdout)
        return
    row = measure(args.clients, args.tokens, args.step_ms, args.burst, args.reps, args.profile)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
