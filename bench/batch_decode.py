"""Batched decode against row-by-row decode, in the engine, for one family.

B requests (random prompts of P tokens, temperature 0, no stop ids) are
admitted and prefilled; once every row decodes, ``steps`` engine steps are
timed. Each step gives every row one token, so the aggregate decode rate is
``B * steps / wall``. Two ways, on the same runner class and install:

- ``batched``: the engine as shipped; the rows' sessions are merged and
  every step is one forward (``turbospark_forward_batch``);
- ``row_by_row``: the same engine told that the family does not batch
  (``Runner.batchable`` False, which is what a family without the batched
  hook or with a component that is not ``batchable`` gets): every step is B
  one-row forwards. This is how qwen4_exp decoded before its components
  learned to merge.

For qwen4_exp two prompt lengths matter: a short one keeps every QSA query
dense (one masked attention for the whole batch), a long one makes it sparse
(each row attends alone over its own K/V and block selection); the sizes in
:mod:`bench.common` put the boundary at 128 (``small``) and 512 (``large``)
tokens. Reported per (P, B): both rates, their ratio, and each run's rate
(``reps`` runs, median reported).

Run: ``uv run python bench/batch_decode.py --family qwen4_exp --size small``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import random_tokens
from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import GenerationConfig
from turbospark.generation.runner import Runner
from turbospark.text import load_text

WAYS = ("batched", "row_by_row")


class RowByRowRunner(Runner):
    """A runner whose family the engine treats as not batchable."""

    @property
    def batchable(self) -> bool:
        return False


def _rate(path: Path, way: str, batch: int, prompt: int, steps: int, seed: int) -> float:
    """Aggregate decode tokens per second of *batch* rows decoding *steps* steps."""
    runner = Runner.open(path, context_length=prompt + steps + 64, session_slots=1)
    if way == "row_by_row":
        runner.__class__ = RowByRowRunner
    runner.set_prefix_reuse(False)
    engine = Engine(runner, load_text(path), max_batch=batch)
    warm = 4
    config = GenerationConfig(max_tokens=warm + steps + 8, temperature=0.0, stop_token_ids=[])
    for i in range(batch):
        ids = random_tokens(prompt, runner.vocab_size, seed=seed + i)
        engine.submit(Job(ids=ids, config=config, emit=lambda item: None))
    for _ in range(100_000):  # admit and prefill every prompt
        engine.step()
        if not engine._prefilling and engine.queue_depth == 0:
            break
    for _ in range(warm):  # the batch forms, kernels for its shapes exist
        engine.step()
    if way == "batched":
        assert engine.batch_size == batch, f"only {engine.batch_size} of {batch} rows batched"
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - started
    runner.close()
    return batch * steps / wall


def bench_batch_decode(
    path: Path,
    batches: tuple[int, ...],
    prompts: tuple[int, ...],
    steps: int,
    reps: int,
) -> dict[str, Any]:
    """Every (prompt length, batch size): batched and row-by-row decode rates."""
    levels: dict[str, Any] = {}
    for prompt in prompts:
        for batch in batches:
            runs: dict[str, list[float]] = {way: [] for way in WAYS}
            for rep in range(reps):
                for way in WAYS if rep % 2 == 0 else WAYS[::-1]:  # alternate who goes first
                    runs[way].append(_rate(path, way, batch, prompt, steps, seed=100 * rep))
            level = {f"{way}_tok_s": statistics.median(runs[way]) for way in WAYS}
            level["ratio"] = level["batched_tok_s"] / level["row_by_row_tok_s"]
            level["per_rep"] = runs
            levels[f"P={prompt},B={batch}"] = level
    return {
        "settings": {"batches": batches, "prompts": prompts, "steps": steps, "reps": reps},
        "levels": levels,
    }


def summary(result: dict[str, Any]) -> list[str]:
    return [
        f"{key:>14}: batched {level['batched_tok_s']:8.1f} tok/s, row by row "
        f"{level['row_by_row_tok_s']:8.1f} tok/s, x{level['ratio']:.2f}"
        for key, level in result["levels"].items()
    ]


def main() -> None:
    import argparse
    import json

    from bench.common import DEFAULT_CACHE, SIZES, default_dtype, install, machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen4_exp", choices=sorted(SIZES))
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, action="append", help="repeatable; default 4 8")
    parser.add_argument("--prompt", type=int, action="append", help="repeatable; default 32 256")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3, help="medians reported")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dtype = args.dtype or default_dtype()
    path = install(args.family, args.size, dtype, args.cache_dir)
    result = bench_batch_decode(
        path, tuple(args.batch or (4, 8)), tuple(args.prompt or (32, 256)), args.steps, args.reps
    )
    report = {"machine": machine(), "family": args.family, "size": args.size, "dtype": dtype}
    report["batch_decode"] = result
    if args.json:
        json.dump(report, sys.stdout, indent=2)
    else:
        print(f"== {args.family} ({args.size}, {dtype})", *summary(result), sep="\n")


if __name__ == "__main__":
    main()
