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
  (each thread's own CPU-time clock, so load-independent), divided by the decode steps;
  ``text_cpu_ms_per_request``: the prompt pool's threads (chat template and
  tokenizer; the template holds the GIL) per request; ``other_cpu_ms_per_step``:
  the rest of the process (MLX's own threads: on the CPU, the compute);
- ``time`` / ``runner_cpu``: wall and runner CPU seconds in steps that
  prefilled, decode-only steps of the full batch and of fewer rows, and
  (wall) between steps;
- ``steps``, ``full_steps``, ``prefill_steps`` and each batch size's steps;
- ``prefill_forwards`` / ``decode_forwards``: forwards built while timed, of
  prompt tokens (a batched group's or one row's chunk) and of decode steps.
  On a host-bound GPU a forward costs about a decode step whatever its
  tokens, so these counts say what the prefill scheduling costs there;
- aggregate completion tok/s and TTFT p50 of the clients.

With ``profile``, :class:`bench.thread_profile.ThreadSampler` samples the
runner thread (prefill steps, decode steps and between steps apart) and the
event loop's thread, each sample charged with the thread's CPU time since the
last (``top_{own,cumulative}_cpu_ms_{prefill,decode,between,loop}``). Two
``cProfile`` profilers, one per thread, did this before; Python 3.12 allows
one for the whole process, and the second one's ``enable()`` failed every
engine step, which hung the H200 run (see :mod:`bench.thread_profile`).

The measurement runs in a child process that is killed, with its clients,
once ``time_limit_s`` has passed (:func:`bench_server_step` then raises
:class:`TimeoutError`), so a GPU run can never hang on this piece; every
wait inside it is bounded too.

On the H200 the engine's step is host-bound (its CPU time is its wall time),
so CPU time the event loop spends per step competes with it for the GIL.
On the CPU the small ``chat_host`` shapes (chat_large's 16 layers, tiny
widths) make the forward cheap, as it is on the GPU.

Run: ``uv run python bench/server_step.py --family gemma4 --clients 16``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.concurrency import ConcurrencyPlan, conversations, percentile, run_clients
from bench.serving import MODEL
from bench.thread_profile import ThreadSampler

WARM_UP_TOKENS = 8
CONTEXT_LENGTH = 8192
TIME_LIMIT_S = 600.0  # the whole measurement, server start to the engine-alone steps
TIMED_OUT = 124  # the child's exit status when it ran out of time (as timeout(1)'s)
ROOT = Path(__file__).resolve().parents[1]


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
    # Forwards built while recording: prompt tokens (batched groups and one-row
    # chunks) and decode steps (batched, or one row's lazy id).
    forwards: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    # Each batched prefill forward's shape: rows, new tokens a row, and the
    # positions its rows start at (what decides whether MLX has run it before).
    groups: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    # What the runner thread does now, for the sampler: "prefill" or "decode"
    # inside a recorded step, "between" outside one while recording.
    phase: str | None = None

    def runner_phase(self) -> str | None:
        return (self.phase or "between") if self.recording else None


def _thread_cpu_s(ident: int) -> float:
    """User plus system CPU time of the thread whose ``threading`` ident is
    *ident*, from its own CPU-time clock (nanoseconds; ``/proc`` counts 10 ms
    ticks, which a short run's event loop can stay under)."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def _instrument(engine: Any, log: StepLog) -> None:
    """Record every step of *engine* (the loop calls ``self.step()``, so an
    instance attribute takes its place)."""
    real_step = engine.step

    def step() -> bool:
        if not log.recording:
            return real_step()
        prefilling = bool(engine._prefilling) or bool(engine._queue)
        log.phase = "prefill" if prefilling else "decode"
        began, cpu0 = time.perf_counter(), time.thread_time()
        try:
            busy = real_step()
        finally:
            log.phase = None
        ended = time.perf_counter()
        if busy:
            log.began.append(began)
            log.ended.append(ended)
            log.cpu.append(time.thread_time() - cpu0)
            log.batch.append(engine.batch_size)
            log.prefilled.append(prefilling or bool(engine._prefilling))
        return busy

    engine.step = step
    runner = engine.runner
    batched, one_row = runner.forward_batch, runner.feed

    def forward_batch(tokens: Any, *args: Any, **kwargs: Any) -> Any:
        if log.recording:
            log.forwards["prefill" if tokens.shape[1] > 1 else "decode"] += 1
            if tokens.shape[1] > 1:
                log.groups.append((tokens.shape[0], tokens.shape[1], tuple(args[0])))
        return batched(tokens, *args, **kwargs)

    def feed(session: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        if log.recording:
            log.forwards["prefill" if isinstance(tokens[0], int) else "decode"] += 1
        return one_row(session, tokens, *args, **kwargs)

    runner.forward_batch, runner.feed = forward_batch, feed


def _plan(spec: dict[str, Any]) -> ConcurrencyPlan:
    return ConcurrencyPlan(**{**spec, "clients": tuple(spec["clients"])})


def _left(deadline: float) -> float:
    """Seconds until *deadline* (``time.monotonic``); TimeoutError once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("bench/server_step.py ran out of its time limit")
    return left


def drive(
    base: str, clients: int, plan: ConcurrencyPlan, seed: int, tokens: int, deadline: float
) -> dict[str, Any]:
    """The clients, in a subprocess so that their Python never holds the server's GIL."""
    spec = {"base": base, "clients": clients, "plan": plan.__dict__, "seed": seed, "tokens": tokens}
    out = subprocess.run(
        [sys.executable, "-m", "bench.server_step", "--drive", json.dumps(spec)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=_left(deadline),
    )
    return json.loads(out.stdout)


def _drive_main(spec: dict[str, Any]) -> None:
    plan = _plan(spec["plan"])
    chats = conversations(spec["clients"], plan, spec["seed"])
    run = run_clients(spec["base"], chats, spec["tokens"], {"ignore_eos": True})
    json.dump(run, sys.stdout)


def measure_server(
    path: Path, clients: int, plan: ConcurrencyPlan, profile: bool, deadline: float
) -> dict[str, Any]:
    """Serve *path* in this process and run *clients* chats against it, every
    step recorded; TimeoutError past *deadline* (``time.monotonic``)."""
    from turbospark.commands.serve import DEFAULT_PREFILL_BUDGET
    from turbospark.generation.runner import Runner
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
        prefill_budget=DEFAULT_PREFILL_BUDGET,  # as `turbospark serve`
        worker=worker,
        max_batch=clients,
        warm_up=[0] * (chunk + 1),  # as `turbospark serve` warms up
    )
    engine = app.state.service.engine
    log = StepLog()
    _instrument(engine, log)
    with ThreadedServer(app) as server:
        base = server.base_url
        while httpx.get(f"{base}/health", timeout=_left(deadline)).json()["status"] != "ok":
            _left(deadline)
            time.sleep(0.1)
        runner_ident = engine.call(threading.get_ident).result(timeout=_left(deadline))
        loop_ident = server._thread.ident
        assert loop_ident is not None
        # As bench/concurrency.py: one burst of every client's first turn, short.
        drive(base, clients, plan, plan.seed - 1, WARM_UP_TOKENS, deadline)
        sampler = None
        if profile:
            sampler = ThreadSampler()
            sampler.watch(runner_ident, log.runner_phase)
            sampler.watch(loop_ident, lambda: "loop" if log.recording else None)
            sampler.start()
        log.recording = True
        # The prompt pool (chat template and tokenizer) holds the GIL while it renders.
        text = [t.ident for t in threading.enumerate() if t.name.startswith("turbospark-text")]
        idents = {"runner": [runner_ident], "loop": [loop_ident], "text": [t for t in text if t]}
        cpu0 = {name: sum(_thread_cpu_s(t) for t in ids) for name, ids in idents.items()}
        process0 = time.process_time()
        try:
            run = drive(base, clients, plan, plan.seed, plan.reply_tokens, deadline)
        finally:
            log.recording = False
            if sampler is not None:
                sampler.stop()
        text = [t.ident for t in threading.enumerate() if t.name.startswith("turbospark-text")]
        idents["text"] = [t for t in text if t]  # the pool starts its threads on demand
        cpu = {
            name: sum(_thread_cpu_s(t) for t in ids) - cpu0[name] for name, ids in idents.items()
        }
        process = time.process_time() - process0
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
        "prefill_forwards": log.forwards["prefill"],
        "decode_forwards": log.forwards["decode"],
        "prefill_groups": log.groups,
        "distinct_group_shapes": len({(b, n) for b, n, _ in log.groups}),
        "steps_per_batch": dict(sorted(per_batch.items())),
        "time": spent,
        "runner_cpu": host,
        "wall_s": run["wall_s"],
        "completion_tok_s": run["completion_tok_s"],
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": percentile(ttfts, 95),
    }
    for kind, sampled in (sampler.profiles if sampler is not None else {}).items():
        for name in ("cumulative", "own"):
            out[f"top_{name}_cpu_ms_{kind}"] = sampled.top(name)
    return out


def _measure(path: Path, clients: int, plan: ConcurrencyPlan, steps: int, profile: bool,
             deadline: float) -> dict[str, Any]:  # fmt: skip
    """The server's step (:func:`measure_server`) and the engine's alone at B = *clients*."""
    from bench.step_cost import measure

    served = measure_server(path, clients, plan, profile, deadline)
    _left(deadline)
    alone = measure(path, clients, steps, 0.0, False)
    served["engine_step_ms"] = alone["wall_ms_per_step"]
    served["engine_host_ms"] = alone["host_ms_per_step"]
    served["server_over_engine"] = served["server_step_ms"] / alone["wall_ms_per_step"]
    return served


def bench_server_step(
    path: Path,
    clients: int,
    plan: ConcurrencyPlan,
    steps: int = 100,
    profile: bool = False,
    time_limit_s: float = TIME_LIMIT_S,
) -> dict[str, Any]:
    """:func:`_measure` in a child process, killed with its clients after
    *time_limit_s* (then TimeoutError): whatever goes wrong in the server under
    test (a step that fails forever, a lost reply), the caller gets control back."""
    spec = {"path": str(path), "clients": clients, "plan": plan.__dict__, "steps": steps,
            "profile": profile, "time_limit_s": time_limit_s}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="server-step-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench.server_step", "--measure", json.dumps(spec), "--result", str(result)]  # fmt: skip
        # A session of its own: on timeout the whole group (the clients' subprocess too) is killed.
        child = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
        try:
            code = child.wait(timeout=time_limit_s + 30)  # the child bounds itself first
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = TIMED_OUT
        if code == TIMED_OUT:
            raise TimeoutError(
                f"bench/server_step.py on {path.name} did not finish in {time_limit_s:.0f} s"
            )
        if not result.exists():
            raise RuntimeError(f"bench/server_step.py on {path.name} failed (exit {code}); see its stderr")  # fmt: skip
        out = json.loads(result.read_text())
    out["steps_per_batch"] = {int(b): n for b, n in out["steps_per_batch"].items()}  # JSON's keys
    return out


def _measure_main(spec: dict[str, Any], result: Path) -> None:
    """The child of :func:`bench_server_step`: measure, write the result, and
    leave at once (a server thread that does not stop must not hold the exit)."""
    deadline = time.monotonic() + spec["time_limit_s"]
    code = 0
    try:
        out = _measure(Path(spec["path"]), spec["clients"], _plan(spec["plan"]), spec["steps"],
                       spec["profile"], deadline)  # fmt: skip
        result.write_text(json.dumps(out))
    except BaseException as exc:
        traceback.print_exc()
        code = TIMED_OUT if isinstance(exc, (TimeoutError, subprocess.TimeoutExpired)) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def summary(family: str, row: dict[str, Any]) -> str:
    return (
        f"{family} N={row['clients']}: server step {row['server_step_ms']:.2f} ms "
        f"(inside step {row['server_step_inside_ms']:.2f}, runner CPU {row['server_step_host_ms']:.2f}) "
        f"vs engine step {row['engine_step_ms']:.2f} ms (CPU {row['engine_host_ms']:.2f}): "
        f"x{row['server_over_engine']:.2f} | per decode step: loop CPU {row['loop_cpu_ms_per_step']:.2f} ms, "
        f"runner CPU {row['runner_cpu_ms_per_step']:.2f}, other {row['other_cpu_ms_per_step']:.2f}; "
        f"prompt pool CPU {row['text_cpu_ms_per_request']:.2f} ms a request | "
        f"{row['completion_tok_s']:.0f} tok/s, TTFT p50 {1e3 * row['ttft_p50_s']:.0f} ms | "
        f"steps {row['steps']} (full {row['full_steps']}, prefill {row['prefill_steps']}; "
        f"forwards: prefill {row.get('prefill_forwards', '?')}, decode {row.get('decode_forwards', '?')})\n"
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
    parser.add_argument(
        "--profile", action="store_true", help="sample the runner's and event loop's threads"
    )
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds a family")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--drive", help=argparse.SUPPRESS)  # the clients' subprocess
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # bench_server_step's child
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        _drive_main(json.loads(args.drive))
        return
    if args.measure:
        _measure_main(json.loads(args.measure), args.result)
        return
    from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install, machine

    plan = ConcurrencyPlan(
        clients=(args.clients,), turns=args.turns, reply_tokens=args.reply_tokens
    )
    dtype = args.dtype or default_dtype()
    report: dict[str, Any] = {"machine": machine(), "dtype": dtype, "size": args.size}
    for family in args.family or FAMILIES:
        path = install(family, args.size, dtype, args.cache_dir or DEFAULT_CACHE)
        report[family] = bench_server_step(
            path, args.clients, plan, profile=args.profile, time_limit_s=args.time_limit
        )
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
