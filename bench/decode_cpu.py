"""Process CPU time and wall time per decoded token, compiled against uncompiled, in one process.

On a loaded machine wall-clock decode rates move several-fold between reps,
but the CPU time a process spends per token does not wait for a free core, so
it compares two builds of the same loop where tok/s cannot. On a quiet
machine wall time is what a user waits, and CPU time also counts OpenBLAS's
threads (a stacked projection's larger GEMM runs on both cores where two
small ones ran on one), so it prints both. Runs
:func:`turbospark.generation.generate.stream_generate` (a 512-token prompt, then 32
tokens) with compilation on and off (``mx.disable_compile()``), alternating
which goes first, and prints the median and minimum over reps::

    uv run python bench/decode_cpu.py gemma4 [--size small] [--reps 8]

It imports nothing from ``bench.decode_cost``, so it runs unchanged against
an older checkout (put that checkout's ``core`` and ``plugins/*`` first on
``PYTHONPATH``) for a before/after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from bench.common import DEFAULT_CACHE, install, random_tokens
from turbospark.generation.generate import GenerationConfig, stream_generate
from turbospark.generation.runner import Runner
from turbospark.text import load_text

DECODE = 32


def ms_per_token(
    runner: Runner, path: Path, prompt: list[int], compiled: bool
) -> tuple[float, float]:
    """Process CPU ms and wall ms per decoded token (after the first, which
    ends the prefill)."""
    config = GenerationConfig(max_tokens=DECODE + 1, stop_token_ids=[], chunk_size=256)
    if not compiled:
        mx.disable_compile()
    try:
        started = None
        for _ in stream_generate(runner, load_text(path), prompt, config):
            if started is None:  # the first token ends the prefill
                started = time.process_time(), time.perf_counter()
        cpu, wall = time.process_time() - started[0], time.perf_counter() - started[1]
        return cpu / DECODE * 1e3, wall / DECODE * 1e3
    finally:
        mx.enable_compile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("family", choices=["gemma4", "qwen_gdn"])
    parser.add_argument("--size", default="small")
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    path = install(args.family, args.size, "float32", DEFAULT_CACHE)
    runner = Runner.open(path, context_length=600)
    prompt = random_tokens(512, runner.vocab_size, seed=1)
    samples: dict[str, list[tuple[float, float]]] = {"compiled": [], "uncompiled": []}
    for rep in range(args.reps + 1):  # rep 0 warms both up
        order = ("compiled", "uncompiled") if rep % 2 else ("uncompiled", "compiled")
        for mode in order:
            value = ms_per_token(runner, path, prompt, mode == "compiled")
            if rep:
                samples[mode].append(value)
    for mode, pairs in samples.items():
        for kind, values in zip(("CPU", "wall"), zip(*pairs, strict=True), strict=True):
            print(
                f"{args.family} {args.size} {mode}: {kind} ms per token median "
                f"{statistics.median(values):.2f}, min {min(values):.2f}, max {max(values):.2f}"
            )


if __name__ == "__main__":
    main()
