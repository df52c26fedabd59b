"""The host cost of one decode step, measured where nothing else is: the
``host`` sizes (the large sizes' 16 layers at tiny widths, float32, CPU), so
the step is all Python graph building and per-kernel work.

Per engine (ours compiled, ours with compilation off, mlx-lm's model):

- ``cpu_us``: CPU time of the calling thread to build one step's graph
  (``time.thread_time``; nothing evaluated), median over ``--steps`` steps.
  MLX evaluates on its own threads, so this changes little when other
  processes load the machine, unlike wall time;
- ``kernels`` / ``primitives``: MLX's graph of one step, exported with
  ``mx.export_to_dot`` (:func:`bench.decode_cost.graph_primitives`; exact,
  and load-independent). On a GPU each kernel costs its encoding on the host
  too (about 9 µs each on MLX's CUDA backend).

Run: ``uv run python bench/host_cost.py [--family F ...] [--steps 200] [--json]``.
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
from turbospark.runner import Runner

PROMPT_TOKENS = 64


def measure(step: Step, steps: int) -> dict[str, float]:
    """Median thread CPU µs to build a step (after 5 warm-ups), and its graph."""
    for i in range(5):
        mx.eval(step(i))
    spent = []
    for i in range(steps):
        began = time.thread_time()
        outputs = step(i)
        spent.append(time.thread_time() - began)
        mx.eval(outputs)
    return {"cpu_us": statistics.median(spent) * 1e6, **graph_primitives(step(steps))}


def host_cost(family: str, steps: int, cache_dir: Path) -> dict[str, dict[str, float]]:
    path = install(family, "host", "float32", cache_dir)
    runner = Runner.open(path, context_length=PROMPT_TOKENS + 2 * steps + 64)
    prompt = random_tokens(PROMPT_TOKENS, runner.vocab_size, seed=1)
    result = {"ours": measure(_ours_step(runner, prompt), steps)}
    with compile_off():
        result["ours_uncompiled"] = measure(_ours_step(runner, prompt), steps)
    model, _ = load_model(path)
    result["mlx_lm"] = measure(_theirs_step(model, prompt, runner.vocab_size), steps)
    runner.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    report: dict[str, Any] = {"machine": machine()}
    for family in args.family or FAMILIES:
        report[family] = host_cost(family, args.steps, args.cache_dir)
        if not args.json:
            for engine, row in report[family].items():
                print(
                    f"{family} {engine:>15}: {row['cpu_us']:7.0f} µs CPU to build, "
                    f"{row['kernels']} kernels, {row['primitives']} primitives"
                )
    if args.json:
        json.dump(report, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
