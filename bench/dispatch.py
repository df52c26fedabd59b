"""Dispatch overhead: what the pluggy hook path and the runner add per decoded token.

Three ways to decode the same tokens on the same weights, interleaved:

- ``direct``: the family's ``turbospark_forward`` called as a plain function;
- ``hook``: the same through ``pm.hook.turbospark_forward`` (pluggy);
- ``runner``: :meth:`Runner.produce` (input validation, the prefix record,
  ``mx.async_eval``, on top of the hook).

The model is the tiny one so the fixed per-token costs are visible. A
micro-benchmark of a trivial hook (``turbospark_family``) called both ways
isolates pluggy's own cost from the noise of a forward.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from bench.common import interleaved, median_of, random_tokens
from turbospark.generation.runner import Runner
from turbospark.loading.install import read_manifest
from turbospark.loading.plugins import default_registry

PREFIX = 8


def _per_call_us(fn: Callable[[], Any], calls: int, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples) * 1e6


def bench_dispatch(path: Path, tokens: int, reps: int) -> dict[str, Any]:
    manifest = read_manifest(path)
    family = default_registry().get(manifest.family)
    hook = family.manager().hook
    runner = Runner.open(path, context_length=PREFIX + tokens + 2)
    model, arch = runner.model, runner.arch
    prompt = random_tokens(PREFIX, arch.vocab_size, seed=3)

    def via(forward: Callable[..., mx.array | None]) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            state = hook.turbospark_new_state(
                arch=arch, model=model, context_length=PREFIX + tokens
            )
            logits = forward(
                model=model,
                tokens=mx.array(prompt),
                start=0,
                state=state,
                vision=None,
                steer=None,
                logits="last",
            )
            token = int(mx.argmax(logits).item())
            start = time.perf_counter()
            for i in range(tokens):
                logits = forward(
                    model=model,
                    tokens=mx.array([token]),
                    start=PREFIX + i,
                    state=state,
                    vision=None,
                    steer=None,
                    logits="last",
                )
                token = int(mx.argmax(logits).item())
            return {"per_token_s": (time.perf_counter() - start) / tokens}

        return run

    def via_runner() -> dict[str, float]:
        runner.reset()
        token = int(mx.argmax(runner.prefill_chunk(prompt, 0)).item())
        start = time.perf_counter()
        for i in range(tokens):
            token = int(mx.argmax(runner.produce(token, PREFIX + i)).item())
        return {"per_token_s": (time.perf_counter() - start) / tokens}

    samples = interleaved(
        {
            "direct": via(family.plugin.turbospark_forward),
            "hook": via(hook.turbospark_forward),
            "runner": via_runner,
        },
        reps,
    )
    us = {name: median_of(rows, "per_token_s") * 1e6 for name, rows in samples.items()}
    return {
        "tokens": tokens,
        "reps": reps,
        "per_token_us": us,
        "hook_overhead_us": us["hook"] - us["direct"],
        "runner_overhead_us": us["runner"] - us["hook"],
        "pluggy_call_us": _per_call_us(hook.turbospark_family, 2000, 5),
        "plain_call_us": _per_call_us(family.plugin.turbospark_family, 2000, 5),
    }
