"""Host cost of one batched decode step of the engine, per step and per row.

The concurrency benchmark times whole servers; this one isolates the
engine's batched decode step on the runner thread. B requests (fixed prompts,
no stop ids, temperature 0 unless ``--temperature``) are admitted and
prefilled, then ``--steps`` decode steps are timed once every row decodes in
the merged batched state. Reported per B:

- ``host_ms_per_step``: CPU time of the calling thread per step
  (``time.thread_time``). MLX evaluates on its own threads, so this is the
  Python work that builds and hands off a step, and it changes little when
  other processes load the machine. Split into ``forward_ms_per_step`` (the
  family's forward, ``runner.forward_batch``: building the graph),
  ``sample_queue_ms_per_step`` (the rest of ``_Batch.step``: sampling ops and
  ``mx.async_eval``, which builds the step's tasks, and on the CPU also waits
  while more than a few of them are queued) and ``rows_ms_per_step`` (the rest:
  reading the ids, and per row the stop checks, detokenising, emitting);
- ``read_wait_ms_per_step``: wall time from the step being queued to its
  rows' ids being read (``tolist``): near zero when the ids read are the ones
  the step before queued (pipelined), a forward's time when they are not;
- ``wall_ms_per_step``: wall time per step (this one does depend on load);
- with ``--profile``, the top functions by own time under cProfile (a second
  run of as many steps; own time of MLX calls lands in their caller).

With ``--mlx-lm``, mlx-lm's ``BatchGenerator`` (what ``mlx_lm.server`` decodes
with) runs the same prompts greedily at each B and its wall time per step is
reported beside ours, ``--reps`` rounds alternating (``mlx_lm_step``).

Run: ``uv run python bench/step_cost.py --family gemma4 --batch 8 --batch 16 [--prompt-tokens 24 --prompt-tokens 320] [--mlx-lm --reps 3]``.
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

from turbospark.generation.engine import Engine, Job, _Batch
from turbospark.generation.generate import GenerationConfig
from turbospark.generation.runner import Runner
from turbospark.text import load_text

PROMPT_TOKENS = 24


def _engine(path: Path, batch: int) -> tuple[Engine, Runner]:
    runner = Runner.open(path, context_length=4096, session_slots=batch)
    runner.set_prefix_reuse(False)
    return Engine(runner, load_text(path), max_batch=batch), runner


def _prompts(batch: int, vocab: int, prompt_tokens: int = PROMPT_TOKENS) -> list[list[int]]:
    """Row ``i``'s prompt: fixed ids, *prompt_tokens* + ``i`` of them (one token
    longer than row ``i - 1``'s, so the rows are ragged, as a server's are)."""
    return [[(7 * i + 3 * j + 1) % vocab for j in range(prompt_tokens + i)] for i in range(batch)]


def _jobs(
    runner: Runner, batch: int, tokens: int, temperature: float, prompt_tokens: int = PROMPT_TOKENS
) -> list[Job]:
    jobs = []
    for i, ids in enumerate(_prompts(batch, runner.vocab_size, prompt_tokens)):
        config = GenerationConfig(
            max_tokens=tokens, temperature=temperature, seed=i, stop_token_ids=[]
        )
        jobs.append(Job(ids=ids, config=config, emit=lambda item: None))
    return jobs


def merge(engine: Engine, batch: int, limit: int = 1000) -> None:
    """Step *engine* until its *batch* submitted rows are admitted, prefilled and
    decoding together in the merged state (at most *limit* steps: a GPU lease
    must never hang on a batch that does not form)."""
    for _ in range(limit):
        engine.step()
        if engine.batch_size == batch and not engine._prefilling and not engine._solo:
            return
    raise AssertionError(f"only {engine.batch_size} of {batch} rows batched after {limit} steps")


def measure(
    path: Path,
    batch: int,
    steps: int,
    temperature: float,
    profile: bool,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict[str, Any]:
    """Time *steps* decode steps with *batch* rows in the merged state, each
    row's history about *prompt_tokens* long (a chat server's rows hold a few
    hundred: what grows with it, attention and its mask, shows against 24)."""
    engine, runner = _engine(path, batch)
    warm = 8
    for job in _jobs(runner, batch, warm + 2 * steps + 4, temperature, prompt_tokens):
        engine.submit(job)
    merge(engine, batch)
    for _ in range(warm):
        engine.step()
    assert engine.batch_size == batch, f"only {engine.batch_size} of {batch} rows batched"
    spent = {"forward": 0.0, "step": 0.0, "wait": 0.0}
    queued = [0.0]
    real_forward, real_step, real_check = runner.forward_batch, _Batch.step, runner.check_ids

    def forward(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return real_forward(*args, **kwargs)
        finally:
            spent["forward"] += time.thread_time() - began

    def step(batch: _Batch) -> Any:
        began = time.thread_time()
        try:
            return real_step(batch)
        finally:
            spent["step"] += time.thread_time() - began
            queued[0] = time.perf_counter()

    def check(tokens: list[int]) -> list[int]:
        if queued[0]:
            spent["wait"] += time.perf_counter() - queued[0]
            queued[0] = 0.0
        return real_check(tokens)

    runner.forward_batch, runner.check_ids = forward, check  # type: ignore[method-assign]
    _Batch.step = step  # type: ignore[method-assign]
    try:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            engine.step()
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    finally:
        runner.forward_batch, runner.check_ids = real_forward, real_check  # type: ignore[method-assign]
        _Batch.step = real_step  # type: ignore[method-assign]
    out: dict[str, Any] = {
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "steps": steps,
        "vocab": runner.vocab_size,
        "host_ms_per_step": 1e3 * cpu / steps,
        "forward_ms_per_step": 1e3 * spent["forward"] / steps,
        "sample_queue_ms_per_step": 1e3 * (spent["step"] - spent["forward"]) / steps,
        "rows_ms_per_step": 1e3 * (cpu - spent["step"]) / steps,
        "read_wait_ms_per_step": 1e3 * spent["wait"] / steps,
        "wall_ms_per_step": 1e3 * wall / steps,
    }
    if profile:
        profiler = cProfile.Profile()  # a second run of as many steps
        profiler.enable()
        for _ in range(steps):
            engine.step()
        profiler.disable()
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # type: ignore[attr-defined]
        out["top_own_ms_per_step"] = [
            (f"{Path(f[0]).name}:{f[1]}:{f[2]}", round(1e3 * r[2] / steps, 4), r[1])
            for f, r in rows
        ]
    runner.close()
    return out


def mlx_lm_step(
    path: Path, batch: int, steps: int, vocab: int, prompt_tokens: int = PROMPT_TOKENS
) -> dict[str, Any]:
    """mlx-lm's ``BatchGenerator`` (its server's decode loop) on the same install:
    the same prompts, greedy, no stop ids; *steps* steps timed once every row
    decodes in its generation batch (one ``next_generated`` call a step)."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, _ = load(str(path))
    generator = BatchGenerator(model, max_tokens=2 * steps + 64, stop_tokens=[])
    generator.insert(_prompts(batch, vocab, prompt_tokens))
    for _ in range(1000):  # its prompts prefill, 8 at a time, then all rows decode
        if len(generator.next_generated()) == batch:
            break
    for _ in range(8):
        generator.next_generated()
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        assert len(generator.next_generated()) == batch
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    generator.close()
    return {"host_ms_per_step": 1e3 * cpu / steps, "wall_ms_per_step": 1e3 * wall / steps}


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
    parser.add_argument(
        "--mlx-lm",
        action="store_true",
        help="also time mlx-lm's BatchGenerator step at each B, alternating with ours",
    )
    parser.add_argument("--reps", type=int, default=1, help="with --mlx-lm: rounds of both")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        action="append",
        help=f"each row's history before the timed steps (repeatable; default {PROMPT_TOKENS})",
    )
    args = parser.parse_args()
    dtype = args.dtype or default_dtype()
    report: dict[str, Any] = {"machine": machine(), "dtype": dtype, "size": args.size}
    for family in args.family or FAMILIES:
        path = install(family, args.size, dtype, args.cache_dir)
        report[family] = [
            measure(path, b, args.steps, args.temperature, args.profile, n)
            for n in args.prompt_tokens or (PROMPT_TOKENS,)
            for b in args.batch or (8, 16)
        ]
        if args.mlx_lm:  # rounds of ours then theirs, the first of ours above
            for row in report[family]:
                b, vocab, n = row["batch"], row["vocab"], row["prompt_tokens"]
                ours, theirs = [row["wall_ms_per_step"]], []
                for rep in range(args.reps):
                    theirs.append(mlx_lm_step(path, b, args.steps, vocab, n)["wall_ms_per_step"])
                    if rep + 1 < args.reps:
                        ours.append(measure(path, b, args.steps, 0.0, False, n)["wall_ms_per_step"])
                row["wall_ms_per_step_rounds"], row["mlx_lm_wall_ms_per_step_rounds"] = ours, theirs
        if args.json:
            continue
        for row in report[family]:
            print(
                f"{family} B={row['batch']:>2}, {row['prompt_tokens']} tokens held: host {row['host_ms_per_step']:.2f} ms/step "
                f"(forward {row['forward_ms_per_step']:.2f}, sample+queue "
                f"{row['sample_queue_ms_per_step']:.2f}, rows {row['rows_ms_per_step']:.2f}), "
                f"read wait {row['read_wait_ms_per_step']:.2f}, wall {row['wall_ms_per_step']:.2f} ms/step"
            )
            if "mlx_lm_wall_ms_per_step_rounds" in row:
                print(
                    f"    wall ms/step by round: ours {row['wall_ms_per_step_rounds']}, mlx-lm's "
                    f"BatchGenerator {row['mlx_lm_wall_ms_per_step_rounds']}"
                )
            for name, ms, calls in row.get("top_own_ms_per_step", []):
                print(f"    {ms:8.4f} ms  {calls:>7}  {name}")
    if args.json:
        json.dump(report, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
