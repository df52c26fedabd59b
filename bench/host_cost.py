"""The host cost of one decode step, measured where nothing else is: the
``host`` sizes (the large sizes' 16 layers at tiny widths, float32, CPU), so
the step is all Python graph building and per-kernel work.

Per engine (ours compiled, ours with compilation off, mlx-lm's model, and
our engine's batched forward at B = 8 over merged rows):

- ``cpu_us``: CPU time of the calling thread to build one step's graph
  (``time.thread_time``; nothing evaluated), median over ``--steps`` steps,
  the minimum over ``--rounds`` rounds that interleave the engines. MLX
  evaluates on its own threads, so this moves much less with other
  processes' load than wall time does (contention still adds to it: hence
  the minimum, and every round's median is printed);
- ``kernels`` / ``primitives``: MLX's graph of one step, exported with
  ``mx.export_to_dot`` (:func:`bench.decode_cost.graph_primitives`; exact,
  and load-independent). On a GPU each kernel costs its encoding on the host
  too (about 9 µs each on MLX's CUDA backend).

Run: ``uv run python bench/host_cost.py [--family F ...] [--steps 100] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
from mlx_lm.utils import load_model

from bench.common import DEFAULT_CACHE, FAMILIES, install, machine, random_tokens
from bench.decode_cost import Step, _ours_step, _theirs_step, compile_off, graph_primitives
from bench.step_cost import _engine, _jobs, merge
from turbospark.generation.runner import Runner

PROMPT_TOKENS = 64
BATCH = 8


def measure(step: Step, steps: int) -> float:
    """Median thread CPU µs to build one of *steps* steps (each evaluated after)."""
    spent = []
    for i in range(steps):
        began = time.thread_time()
        outputs = step(i)
        spent.append(time.thread_time() - began)
        mx.eval(outputs)
    return statistics.median(spent) * 1e6


def uncompiled(step: Step) -> Step:
    def run(i: int) -> list[mx.array]:
        with compile_off():
            return step(i)

    return run


def batched_step(path: Path, batch: int) -> tuple[Step, Runner]:
    """The engine's batched forward (``Runner.forward_batch``) over *batch* rows
    merged and decoding, called again and again on that state."""
    engine, runner = _engine(path, batch)
    for job in _jobs(runner, batch, 10**6, 0.0):
        engine.submit(job)
    merge(engine, batch)
    captured: list[tuple[Any, ...]] = []
    real = runner.forward_batch

    def capture(*args: Any) -> mx.array:
        captured.append(args)
        return real(*args)

    runner.forward_batch = capture  # type: ignore[method-assign]
    engine.step()
    runner.forward_batch = real  # type: ignore[method-assign]
    args = captured[-1]

    def step(i: int) -> list[mx.array]:
        del i
        logits = real(*args)
        return [mx.argmax(logits, axis=-1), *[a for c in args[2].values() for a in c.arrays()]]

    return step, runner


def host_cost(
    family: str, steps: int, rounds: int, cache_dir: Path, size: str = "host"
) -> dict[str, dict[str, Any]]:
    """Per engine: the graph of one step, and thread CPU µs to build one: the
    minimum over *rounds* (engines interleaved) of each round's median, and
    every round's median (the spread)."""
    path = install(family, size, "float32", cache_dir)
    runner = Runner.open(path, context_length=PROMPT_TOKENS + 2 * (rounds + 1) * steps + 64)
    prompt = random_tokens(PROMPT_TOKENS, runner.vocab_size, seed=1)
    ours = _ours_step(runner, prompt)
    model, _ = load_model(path)
    batched, batch_runner = batched_step(path, BATCH)
    engines: dict[str, Step] = {
        "ours": ours,
        "ours_uncompiled": uncompiled(ours),
        "mlx_lm": _theirs_step(model, prompt, runner.vocab_size),
        f"ours_batch{BATCH}": batched,
    }
    result: dict[str, dict[str, Any]] = {}
    for name, step in engines.items():
        measure(step, 5)  # warm-up (and compile)
        outputs = step(0)
        result[name] = {**graph_primitives(outputs), "cpu_us_rounds": []}
        mx.eval(outputs)
    for rep in range(rounds):
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        for name in order:
            result[name]["cpu_us_rounds"].append(round(measure(engines[name], steps)))
    for row in result.values():
        row["cpu_us"] = min(row["cpu_us_rounds"])
    runner.close()
    batch_runner.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    report: dict[str, Any] = {"machine": machine()}
    for family in args.family or FAMILIES:
        report[family] = host_cost(family, args.steps, args.rounds, args.cache_dir)
        if not args.json:
            for engine, row in report[family].items():
                print(
                    f"{family} {engine:>15}: {row['cpu_us']:6d} µs CPU to build "
                    f"(rounds {row['cpu_us_rounds']}), {row['kernels']} kernels, "
                    f"{row['primitives']} primitives"
                )
    if args.json:
        json.dump(report, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
