"""How much a family's logits move when every layer's output is nudged.

Explains drafting on the GPU: a verify pass (``k + 1`` tokens, GEMM) and a
one-token step (GEMV) round differently there (TF32 for float32 GEMMs by
default), and a random-weight network that amplifies small differences turns
that into flipped argmaxes, so an oracle drafter's "100 %" drafts get
rejected. Each layer's output is multiplied by ``1 + eps * noise`` (seeded
Gaussian noise, through the steering hook every family already calls) and
the last-token logits of one prefill are compared with the clean run.

    python bench/sensitivity.py [--size medium] [--eps 1e-3] [--family F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import numpy as np

from bench.common import DEFAULT_CACHE, FAMILIES, install, random_tokens
from turbospark.generation.runner import Runner
from turbospark.policies.steering import Steer, SteeringPolicy


class _Nudge:
    """A plain steering hook (no ``join``, so the families call it after every
    layer) that multiplies each layer's output by ``1 + eps * noise``."""

    def __init__(self, eps: float) -> None:
        self.eps, self.key = eps, mx.random.key(0)

    def __call__(self, layer: int, h: mx.array) -> mx.array:
        self.key, key = mx.random.split(self.key)
        return h * (1 + self.eps * mx.random.normal(h.shape, key=key))


def sensitivity(path: Path, eps: float, prompt_tokens: int) -> dict:
    clean = Runner.open(path, context_length=prompt_tokens + 8)
    prompt = random_tokens(prompt_tokens, clean.vocab_size, seed=1)
    want = np.array(clean.prefill_chunk(prompt, 0))
    hidden = clean.arch.hidden_size
    # A zero vector on layer 1 makes the runner pass a hook; Steer.of is swapped for the nudge.
    policy = SteeringPolicy.from_directions({1: np.zeros(hidden, np.float32)}, 0.0, "add")
    original = Steer.of
    Steer.of = classmethod(lambda cls, rows, dtype: _Nudge(eps))  # type: ignore[method-assign]
    try:
        nudged = Runner.open(path, context_length=prompt_tokens + 8, steering=policy)
        got = np.array(nudged.prefill_chunk(prompt, 0))
    finally:
        Steer.of = original  # type: ignore[method-assign]
    return {
        "eps": eps,
        "max_logit_diff": round(float(np.abs(got - want).max()), 5),
        "logit_scale": round(float(np.abs(want).max()), 3),
        "argmax_same": bool(got.argmax() == want.argmax()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", action="append", choices=list(FAMILIES))
    parser.add_argument("--size", default="medium")
    parser.add_argument("--eps", type=float, default=1e-3)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    for family in args.family or FAMILIES:
        path = install(family, args.size, "float32", args.cache_dir)
        line = {"family": family, "size": args.size, **sensitivity(path, args.eps, args.prompt)}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
