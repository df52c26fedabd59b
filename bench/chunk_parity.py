"""Does a multi-token forward give the logits that one-token steps give, here?

Drafting verifies ``k + 1`` tokens in one forward and compares its argmax with
what one-token decode steps would have produced; prefill chunks rely on the
same equality. This teacher-forces one greedy run both ways on the default
device and reports, per position, the largest logit difference and whether
the argmax agrees (one-token steps compiled and with ``mx.disable_compile``).

    python bench/chunk_parity.py [--family F] [--size large] [--dtype float32] [--gpu]
"""

from __future__ import annotations

import argparse
import os

# Before MLX loads: its CUDA GEMMs run float32 as TF32 by default while GEMVs
# (one token) stay full float32, so a k + 1-token verify and one-token steps of
# a float32 model disagree by TF32 rounding, which random-weight gemma4 turns
# into flipped argmaxes. bf16 pieces are unaffected.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import numpy as np

from bench.common import DEFAULT_CACHE, FAMILIES, install, random_tokens
from turbospark.generation.runner import Runner


def _one_by_one(path: Path, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    runner = Runner.open(path, context_length=len(prompt) + n + 8)
    logits = runner.prefill_chunk(prompt, 0)
    tokens, rows = [], []
    for i in range(n):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        logits = runner.produce(token, len(prompt) + i)
        rows.append(np.array(logits.astype(mx.float32)))
    return tokens, np.stack(rows)


def _verified(path: Path, prompt: list[int], tokens: list[int]) -> np.ndarray:
    runner = Runner.open(path, context_length=len(prompt) + len(tokens) + 8)
    runner.prefill_chunk(prompt, 0, logits=False)
    logits = runner.verify(None, tokens, len(prompt))
    return np.array(logits.astype(mx.float32))


def check(path: Path, prompt_tokens: int, n: int) -> dict:
    prompt = random_tokens(prompt_tokens, Runner.open(path).vocab_size, seed=1)
    result = {}
    for label in ("compiled", "uncompiled"):
        if label == "uncompiled":
            mx.disable_compile()
        tokens, steps = _one_by_one(path, prompt, n)
        chunk = _verified(path, prompt, tokens)
        mx.enable_compile()
        gaps = np.abs(steps - chunk).max(axis=-1)
        top2 = np.sort(steps, axis=-1)[:, -2:]
        result[label] = {
            "argmax_agrees": int((steps.argmax(-1) == chunk.argmax(-1)).sum()),
            "positions": n,
            "max_logit_diff": [round(float(g), 5) for g in gaps],
            "top2_margin": [round(float(m), 5) for m in top2[:, 1] - top2[:, 0]],
            "logit_scale": round(float(np.abs(steps).max()), 3),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", action="append", choices=list(FAMILIES))
    parser.add_argument("--size", default="medium")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    mx.set_default_device(mx.gpu if args.gpu else mx.cpu)
    for family in args.family or FAMILIES:
        path = install(family, args.size, args.dtype, args.cache_dir)
        line = {"family": family, "size": args.size, "dtype": args.dtype,
                "device": str(mx.default_device()), **check(path, args.prompt, args.tokens)}  # fmt: skip
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
