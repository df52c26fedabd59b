"""The server's decode step against its engine's step alone, on one install.

``bench/step_cost.py`` times the engine's batched decode step with no server;
``bench/concurrency.py`` times whole servers. This one says how much of the
server's time per step goes outside the engine's step. The server runs in
this process (the app ``turbospark serve`` builds, ``create_app`` on a
:class:`~turbospark.server.worker.RunnerWorker`, on the real uvicorn with
``serve``'s connection settings, :class:`~turbospark.server.background.ThreadedServer`)
so its threads can be read; the N chat clients run in a subprocess (``httpx``,
``bench.concurrency.run_clients``: each a T-turn chat, each turn streamed,
temperature 0, ``ignore_eos``). Every engine step is recorded: its wall time,
the runner thread's CPU time in it, the rows it decoded in the batch and
whether it prefilled. Reported:

- ``server_step_ms``: median wall time from one step's start to the next's,
  over the steps that decoded the full batch (N rows) and prefilled nothing:
  the server's decode step, everything between two steps included;
- ``server_step_inside_ms``: the median wall time inside ``Engine.step`` over
  the same steps, and ``server_step_host_ms``: the runner thread's CPU time in it;
- ``engine_step_ms`` / ``engine_host_ms``: ``step_cost.measure`` at B = N on
  the same install, no server (wall and runner-thread CPU per step);
- ``loop_cpu_ms_per_step`` / ``runner_cpu_ms_per_step``: CPU time of the
  event loop's thread and of the runner thread over the whole timed run
  (from ``/proc``, so load-independent), divided by the decode steps;
  ``text_cpu_ms_per_request``: the prompt pool's threads (chat template and
  tokenizer; the template holds the GIL) per request; ``other_cpu_ms_per_step``:
  the rest of the process (MLX's own threads: on the CPU, the compute);
- ``time`` / ``runner_cpu``: wall and runner CPU seconds in steps that
  prefilled, decode-only steps of the full batch and of fewer rows, and
  (wall) between steps;
- ``steps``, ``full_steps``, ``prefill_steps`` and each batch size's steps;
- aggregate completion tok/s and TTFT p50 of the clients.

On the H200 the engine's step is host-bound (its CPU time is its wall time),
so CPU time the event loop spends per step competes with it for the GIL.
On the CPU the small ``chat_host`` shapes (chat_large's 16 layers, tiny
widths) make the forward cheap, as it is on the GPU.

Run: ``uv run python bench/server_step.py --family gemma4 --clients 16``.
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.concurrency import ConcurrencyPlan, conversations, percentile, run_clients
from bench.serving import MODEL

WARM_UP_TOKENS = 8
CONTEXT_LENGTH = 8192


@dataclass
class StepLog:
    """One record per engine step: wall start and end, the runner thread's CPU
    time in it, the batch size after it, whether it prefilled."""

    began: list[float] = field(default_factory=list)
    ended: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    prefilled: list[bool] = field(default_factory=list)
    recording: bool = False
    # With --profile: cProfile over the steps that prefilled and over the others.
    profiles: dict[str, cProfile.Profile] | None = None


def _thread_cpu_s(tid: int) -> float:
    """User plus system CPU time of thread *tid* of this process (Linux /proc)."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    """Run *fn* on *loop*'s thread and wait for it (a profiler enables per thread)."""
    done = threading.Event()

    def call() -> None:
        fn()
        done.set()

    loop.call_soon_threadsafe(call)
    done.wait(timeout=30)


def _instrument(engine: Any, log: StepLog) -> None:
    """Record every step of *engine* (the loop calls ``self.step()``, so an
    instance attribute takes its place)."""
    real_step = engine.step

    def step() -> bool:
        if not log.recording:
            return real_step()
        prefilling = bool(engine._prefilling) or bool(engine._queue)
        profile = (
            None if log.profiles is None else log.profiles["prefill" if prefilling else "decode"]
        )
        if profile is not None:
            profile.enable()
        began, cpu0 = time.perf_counter(), time.thread_time()
        busy = real_step()
        ended = time.perf_counter()
        if profile is not None:
            profile.disable()
        if busy:
            log.began.append(began)
            log.ended.append(ended)
            log.cpu.append(time.thread_time() - cpu0)
            log.batch.append(engine.batch_size)
            log.prefilled.append(prefilling or bool(engine._prefilling))
        return busy

    engine.step = step


def drive(base: str, clients: int, plan: ConcurrencyPlan, seed: int, tokens: int) -> dict[str, Any]:
    """The clients, in a subprocess so that their Python never holds the server's GIL."""
    spec = {"base": base, "clients": clients, "plan": plan.__dict__, "seed": seed, "tokens": tokens}
    out = subprocess.run(
        [sys.executable, "-m", "bench.server_step", "--drive", json.dumps(spec)],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return json.loads(out.stdout)


def _drive_main(spec: dict[str, Any]) -> None:
    plan = ConcurrencyPlan(**{**spec["plan"], "clients": tuple(spec["plan"]["clients"])})
    chats = conversations(spec["clients"], plan, spec["seed"])
    run = run_clients(spec["base"], chats, spec["tokens"], {"ignore_eos": True})
    json.dump(run, sys.stdout)


def measure_server(
    path: Path, clients: int, plan: ConcurrencyPlan, profile: bool = False
) -> dict[str, Any]:
    """Serve *path* in this process and run *clients* chats against it, every step recorded."""
    from turbospark.runner import Runner
    from turbospark.server.app import create_app
    from turbospark.server.background import ThreadedServer
    from turbospark.server.worker import RunnerWorker
    from turbospark.text import load_text

    worker = RunnerWorker()

    def open_runner() -> Runner:
        runner = Runner.open(path, context_length=CONTEXT_LENGTH, session_slots=clients)
        runner.set_prefix_reuse(True)
        return runner

    runner = worker.run(open_runner)
    chunk = 512
    app = create_app(
        runner,
        load_text(path),
        model_id=MODEL,
        chunk_size=chunk,
        worker=worker,
        max_batch=clients,
        warm_up=[0] * (chunk + 1),  # as `turbospark serve` warms up
    )
    engine = app.state.service.engine
    log = StepLog()
    _instrument(engine, log)
    with ThreadedServer(app) as server:
        base = server.base_url
        deadline = time.monotonic() + 600
        while httpx.get(f"{base}/health").json()["status"] != "ok":
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not finish warming up")
            time.sleep(0.1)
        runner_tid = engine.call(threading.get_native_id).result(timeout=60)
        loop_tid = server._thread.native_id
        assert loop_tid is not None
        # As bench/concurrency.py: one burst of every client's first turn, short.
        drive(base, clients, plan, plan.seed - 1, WARM_UP_TOKENS)
        log.recording = True
        if profile:
            # CPU time (thread_time), so waits do not count and load barely does.
            log.profiles = {kind: cProfile.Profile(time.thread_time) for kind in ("prefill", "decode", "loop")}  # fmt: skip
            # The event loop's thread (the bridge the warm-up burst made knows it).
            _on_loop(app.state.service._loop_bridge.loop, log.profiles["loop"].enable)
        # The prompt pool (chat template and tokenizer) holds the GIL while it renders.
        text = [t.native_id for t in threading.enumerate() if t.name.startswith("turbospark-text")]
        tids = {"runner": [runner_tid], "loop": [loop_tid], "text": [t for t in text if t]}
        cpu0 = {name: sum(_thread_cpu_s(t) for t in ids) for name, ids in tids.items()}
        process0 = time.process_time()
        run = drive(base, clients, plan, plan.seed, plan.reply_tokens)
        text = [t.native_id for t in threading.enumerate() if t.name.startswith("turbospark-text")]
        tids["text"] = [t for t in text if t]  # the pool starts its threads on demand
        cpu = {name: sum(_thread_cpu_s(t) for t in ids) - cpu0[name] for name, ids in tids.items()}
        process = time.process_time() - process0
        if log.profiles is not None:
            _on_loop(app.state.service._loop_bridge.loop, log.profiles["loop"].disable)
        log.recording = False
    steps = len(log.began)
    full = [
        i
        for i in range(steps - 1)
        if log.batch[i] == clients and log.batch[i + 1] == clients and not log.prefilled[i]
    ]
    decoding = sum(1 for b in log.batch if b) or 1
    per_batch: dict[int, int] = {}
    for b in log.batch:
        per_batch[b] = per_batch.get(b, 0) + 1
    # Where the clients' wall time went: steps that prefilled, decode-only steps
    # of the full batch and of fewer rows, and the time between steps.
    spent = {"prefill_s": 0.0, "decode_full_s": 0.0, "decode_partial_s": 0.0, "between_s": 0.0}
    host = {"prefill_s": 0.0, "decode_full_s": 0.0, "decode_partial_s": 0.0}
    for i in range(steps):
        took = log.ended[i] - log.began[i]
        key = "prefill_s" if log.prefilled[i] else "decode_full_s" if log.batch[i] == clients else "decode_partial_s"  # fmt: skip
        spent[key] += took
        host[key] += log.cpu[i]
        if i + 1 < steps:
            spent["between_s"] += log.began[i + 1] - log.ended[i]
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    ttfts = sorted(row["ttft_s"] for row in run["requests"])
    out: dict[str, Any] = {
        "clients": clients,
        "server_step_ms": ms([log.began[i + 1] - log.began[i] for i in full]),
        "server_step_inside_ms": ms([log.ended[i] - log.began[i] for i in full]),
        "server_step_host_ms": ms([log.cpu[i] for i in full]),
        "loop_cpu_ms_per_step": 1e3 * cpu["loop"] / decoding,
        "runner_cpu_ms_per_step": 1e3 * cpu["runner"] / decoding,
        "text_cpu_ms_per_request": 1e3 * cpu["text"] / len(run["requests"]),
        "other_cpu_ms_per_step": 1e3 * (process - sum(cpu.values())) / decoding,
        "steps": steps,
        "decode_steps": decoding,
        "full_steps": len(full),
        "prefill_steps": sum(log.prefilled),
        "steps_per_batch": dict(sorted(per_batch.items())),
        "time": spent,
        "runner_cpu": host,
        "wall_s": run["wall_s"],
        "completion_tok_s": run["completion_tok_s"],
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": percentile(ttfts, 95),
    }
    for kind, profiler in (log.profiles or {}).items():
        stats = pstats.Stats(profiler)
        for name, col in (("cumulative", 3), ("own", 2)):
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][col])[:25]  # type: ignore[attr-defined]
            out[f"top_{name}_cpu_ms_{kind}"] = [
                (f"{Path(f[0]).name}:{f[1]}:{f[2]}", round(1e3 * r[col], 1), r[1]) for f, r in rows
            ]
    return out


def bench_server_step(
    path: Path, clients: int, plan: ConcurrencyPlan, steps: int = 100, profile: bool = False
) -> dict[str, Any]:
    """The server's step (:func:`measure_server`) and the engine's alone at B = *clients*."""
    from bench.step_cost import measure

    served = measure_server(path, clients, plan, profile)
    alone = measure(path, clients, steps, 0.0, False)
    served["engine_step_ms"] = alone["wall_ms_per_step"]
    served["engine_host_ms"] = alone["host_ms_per_step"]
    served["server_over_engine"] = served["server_step_ms"] / alone["wall_ms_per_step"]
    return served


def summary(family: str, row: dict[str, Any]) -> str:
    return (
        f"{family} N={row['clients']}: server step {row['server_step_ms']:.2f} ms "
        f"(inside step {row['server_step_inside_ms']:.2f}, runner CPU {row['server_step_host_ms']:.2f}) "
        f"vs engine step {row['engine_step_ms']:.2f} ms (CPU {row['engine_host_ms']:.2f}): "
        f"x{row['server_over_engine']:.2f} | per decode step: loop CPU {row['loop_cpu_ms_per_step']:.2f} ms, "
        f"runner CPU {row['runner_cpu_ms_per_step']:.2f}, other {row['other_cpu_ms_per_step']:.2f}; "
        f"prompt pool CPU {row['text_cpu_ms_per_request']:.2f} ms a request | "
        f"{row['completion_tok_s']:.0f} tok/s, TTFT p50 {1e3 * row['ttft_p50_s']:.0f} ms | "
        f"steps {row['steps']} (full {row['full_steps']}, prefill {row['prefill_steps']})\n"
        f"    time: "
        + ", ".join(f"{k} {v:.2f}" for k, v in row["time"].items())
        + f" of wall {row['wall_s']:.2f} s; runner CPU: "
        + ", ".join(f"{k} {v:.2f}" for k, v in row["runner_cpu"].items())
        + f"\n    steps per batch size {row['steps_per_batch']}"
    )


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append")
    parser.add_argument("--size", default="chat_host")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="cProfile the runner thread")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--drive", help=argparse.SUPPRESS)  # the clients' subprocess
    args = parser.parse_args()
    if args.drive:
        _drive_main(json.loads(args.drive))
        return
    from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install, machine

    plan = ConcurrencyPlan(
        clients=(args.clients,), turns=args.turns, reply_tokens=args.reply_tokens
    )
    dtype = args.dtype or default_dtype()
    report: dict[str, Any] = {"machine": machine(), "dtype": dtype, "size": args.size}
    for family in args.family or FAMILIES:
        path = install(family, args.size, dtype, args.cache_dir or DEFAULT_CACHE)
        report[family] = bench_server_step(path, args.clients, plan, profile=args.profile)
        if not args.json:
            print(summary(family, report[family]), flush=True)
            for key, rows in report[family].items():
                if key.startswith("top_"):
                    print(f"  {key}:")
                    for name, ms, calls in rows:
                        print(f"    {ms:9.1f} ms  {calls:>7}  {name}")
    if args.json:
        json.dump(report, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
