"""Host cost of one batched decode step of the engine, per step and per row.

The concurrency benchmark times whole servers; this one isolates the
engine's batched decode step on the runner thread. B requests (fixed prompts,
no stop ids, temperature 0 unless ``--temperature``) are admitted and
prefilled, then ``--steps`` decode steps are timed once every row decodes in
the merged batched state. Reported per B:

- ``host_ms_per_step``: CPU time of the calling thread per step
  (``time.thread_time``). MLX evaluates on its own threads, so this is the
  Python work that builds and hands off a step (graph building, masks,
  sampling ops, reading the ids, emitting, stop checks, detokenising), and it
  does not change when other processes load the machine;
- ``wall_ms_per_step``: wall time per step (this one does depend on load);
- ``engine_host_ms_per_step``: the time outside the family's forward
  (``runner.forward_batch``) under cProfile (a second run of as many steps):
  the engine's own cost, inflated by the profiler, plus any wait for MLX
  inside it (on the CPU ``mx.async_eval`` waits while more than a few of its
  tasks are queued);
- the top functions by own time under cProfile (``--profile``).

Run: ``uv run python bench/step_cost.py --family gemma4 --batch 8 --batch 16``.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turbospark.engine import Engine, Job
from turbospark.generate import GenerationConfig
from turbospark.runner import Runner
from turbospark.text import load_text

PROMPT_TOKENS = 24


def _engine(path: Path, batch: int) -> tuple[Engine, Runner]:
    runner = Runner.open(path, context_length=4096, session_slots=batch)
    runner.set_prefix_reuse(False)
    return Engine(runner, load_text(path), max_batch=batch), runner


def _jobs(runner: Runner, batch: int, tokens: int, temperature: float) -> list[Job]:
    vocab = runner.vocab_size
    jobs = []
    for i in range(batch):
        ids = [(7 * i + 3 * j + 1) % vocab for j in range(PROMPT_TOKENS + i)]
        config = GenerationConfig(
            max_tokens=tokens, temperature=temperature, seed=i, stop_token_ids=[]
        )
        jobs.append(Job(ids=ids, config=config, emit=lambda item: None))
    return jobs


def measure(
    path: Path, batch: int, steps: int, temperature: float, profile: bool
) -> dict[str, Any]:
    """Time *steps* decode steps with *batch* rows in the merged state."""
    engine, runner = _engine(path, batch)
    warm = 8
    for job in _jobs(runner, batch, warm + 2 * steps + 4, temperature):
        engine.submit(job)
    for _ in range(1000):  # admit, prefill, join the batch, a few steps
        engine.step()
        if engine.batch_size == batch and not engine._prefilling and not engine._solo:
            break
    for _ in range(warm):
        engine.step()
    assert engine.batch_size == batch, f"only {engine.batch_size} of {batch} rows batched"
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    profiler = cProfile.Profile()  # a second run of as many steps, for the split
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    forward = sum(
        row[3]
        for func, row in stats.stats.items()  # type: ignore[attr-defined]
        if func[2] == "forward_batch" and func[0].endswith("runner.py")
    )
    total = sum(row[2] for row in stats.stats.values())  # type: ignore[attr-defined]
    out: dict[str, Any] = {
        "batch": batch,
        "steps": steps,
        "host_ms_per_step": 1e3 * cpu / steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "profiled_ms_per_step": 1e3 * total / steps,
        "forward_ms_per_step": 1e3 * forward / steps,
        "engine_host_ms_per_step": 1e3 * (total - forward) / steps,
    }
    if profile:
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # type: ignore[attr-defined]
        out["top_own_ms_per_step"] = [
            (f"{Path(f[0]).name}:{f[1]}:{f[2]}", round(1e3 * r[2] / steps, 4), r[1])
            for f, r in rows
        ]
    runner.close()
    return out


def main() -> None:
    import argparse
    import json

    from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install, machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--size", default="chat")
    parser.add_argument("--batch", type=int, action="append", help="repeatable; default 8 16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--profile", action="store_true", help="list the top functions")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dtype = args.dtype or default_dtype()
    report: dict[str, Any] = {"machine": machine(), "dtype": dtype, "size": args.size}
    for family in args.family or FAMILIES:
        path = install(family, args.size, dtype, args.cache_dir)
        report[family] = [
            measure(path, b, args.steps, args.temperature, args.profile)
            for b in args.batch or (8, 16)
        ]
        if args.json:
            continue
        for row in report[family]:
            print(
                f"{family} B={row['batch']:>2}: host {row['host_ms_per_step']:.2f} ms/step "
                f"(engine {row['engine_host_ms_per_step']:.2f}, forward "
                f"{row['forward_ms_per_step']:.2f} under cProfile), wall "
                f"{row['wall_ms_per_step']:.2f} ms/step"
            )
            for name, ms, calls in row.get("top_own_ms_per_step", []):
                print(f"    {ms:8.4f} ms  {calls:>7}  {name}")
    if args.json:
        json.dump(report, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
