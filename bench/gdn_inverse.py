"""Chunked gated-delta prefill with each way of inverting ``I + M``: LAPACK's
``tri_inv`` on the CPU stream vs matmul doubling on the default device.

On a GPU the first costs a GPU->CPU->GPU round trip per layer and chunk; this
measures what that costs (and checks both give the same logits)::

    python bench/gdn_inverse.py [--size large] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import default_dtype, install, random_tokens
from turbospark import Runner
from turbospark.layers.gated_delta import rule as gated_delta


def lapack_on_cpu(m: mx.array) -> mx.array:
    c = m.shape[-1]
    return mx.linalg.tri_inv(mx.eye(c, dtype=m.dtype) + m, upper=False, stream=mx.cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="large")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/bench-cache"))
    args = parser.parse_args()
    path = install("qwen_gdn", args.size, default_dtype(), args.cache_dir)
    runner = Runner.open(path, context_length=args.tokens + 8)
    prompt = random_tokens(args.tokens, runner.vocab_size, seed=1)

    def prefill() -> tuple[float, mx.array]:
        runner.reset()
        start = time.perf_counter()
        for begin in range(0, args.tokens, args.chunk):
            logits = runner.prefill_chunk(prompt[begin : begin + args.chunk], begin)
        mx.eval(logits)
        return time.perf_counter() - start, logits

    results = {}
    for name, inverse in (
        ("doubling", gated_delta._doubling_inverse),
        ("tri_inv_cpu", lapack_on_cpu),
    ):
        gated_delta._unit_lower_inverse = inverse
        prefill()  # warm-up
        times, logits = zip(*(prefill() for _ in range(args.reps)), strict=True)
        results[name] = (statistics.median(times), logits[-1])
        print(f"{name:12s} {args.tokens / results[name][0]:10.0f} tok/s", flush=True)
    # mlx-lm's logits on the same install and chunks, as the yardstick for both.
    model, _ = load_model(path)
    cache = model.make_cache()
    tokens = mx.array(prompt)[None]
    for begin in range(0, args.tokens, args.chunk):
        theirs = model(tokens[:, begin : begin + args.chunk], cache=cache)[0, -1].astype(mx.float32)
    scale = mx.std(theirs).item()
    for name, (_, ours) in results.items():
        diff = mx.abs(ours - theirs).max().item()
        print(f"{name:12s} max |logit - mlx-lm| {diff:.3e} (mlx-lm logit std {scale:.3f})")


if __name__ == "__main__":
    main()
