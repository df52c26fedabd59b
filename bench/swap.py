"""Swap cost against context length, and what a parked session costs in memory.

Two conversations of ``L`` tokens each share a two-slot runner: one live, one
parked. A turn of the parked one (its whole history plus one token) makes
:meth:`Runner.try_reuse_prefix` swap it in; the next turn of the other swaps
back. Parking moves references, so the state part of a swap must not grow with
``L``; choosing the session compares token ids against every record, which is
linear in ``L`` (timed on its own, so the two costs are not confused).

Memory: ``session_nbytes()`` of a session against the growth of MLX's active
memory while it was prefilled, and the change of active memory across a swap
(zero when nothing is copied). For scale, the same table carries what a switch
costs without the pool (prefilling ``L`` tokens again) and what mlx-lm's
server pays on a cache hit (``LRUPromptCache.fetch_nearest_cache``, which
deep-copies the cached KV).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.utils import load_model

from bench.common import random_tokens
from turbospark.generation.runner import Runner
from turbospark.sessions.prefix import PrefixRecord

CHUNK = 512


def _prefill(runner: Runner, tokens: list[int]) -> float:
    """Feed *tokens* into a fresh live session; seconds taken."""
    start = time.perf_counter()
    for begin in range(0, len(tokens), CHUNK):
        runner.prefill_chunk(tokens[begin : begin + CHUNK], begin, logits=False)
    mx.synchronize()  # the forward hook evaluated the state; wait for the device too
    return time.perf_counter() - start


def _active() -> int:
    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


def _mlx_lm_fetch(path: Path, tokens: list[int], reps: int) -> float:
    """Median seconds of a cache hit in mlx-lm's server cache for *tokens*."""
    model, _ = load_model(path)
    cache = model.make_cache()
    for begin in range(0, len(tokens), CHUNK):
        model(mx.array(tokens[begin : begin + CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])
    lru = LRUPromptCache(max_size=4)
    lru.insert_cache("bench", tokens, cache)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        copy, _rest = lru.fetch_nearest_cache("bench", [*tokens, 7])
        mx.eval([c.state for c in copy])
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _scoring_s(tokens: list[int], reps: int) -> float:
    """Median seconds of one ``common_prefix`` over a record of ``len(tokens)`` ids."""
    record = PrefixRecord()
    record.write(0, tokens)
    prompt = [*tokens, 7]
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        record.common_prefix(prompt)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_swap(path: Path, lengths: list[int], reps: int, compare_mlx_lm: bool) -> dict[str, Any]:
    rows = []
    for length in lengths:
        # A fresh runner per length, so the memory baseline holds no session at all.
        runner = Runner.open(path, context_length=length + 8, session_slots=2)
        runner.set_prefix_reuse(True)
        a = random_tokens(length, runner.vocab_size, seed=length)
        b = random_tokens(length, runner.vocab_size, seed=length + 1)
        b[0] = a[0] + 1 if a[0] + 1 < runner.vocab_size else a[0] - 1  # nothing in common
        base = _active()
        prefill_s = _prefill(runner, a)
        grown = _active() - base
        nbytes = runner.session_nbytes()[0]
        runner.reset()  # park A
        _prefill(runner, b)
        before = _active()
        swaps = []
        for rep in range(reps):
            prompt = [*(a if rep % 2 == 0 else b), 7]
            start = time.perf_counter()
            kept = runner.try_reuse_prefix(prompt)
            swaps.append(time.perf_counter() - start)
            if kept != length or not runner.last_reuse.swapped:
                raise RuntimeError(f"expected a swap keeping {length}, got {runner.last_reuse}")
        after = _active()
        start = time.perf_counter()
        runner.reset()  # parks the live session, promotes (and clears) the other
        reset_s = time.perf_counter() - start
        row = {
            "history_tokens": length,
            "swap_ms": statistics.median(swaps) * 1e3,
            "scoring_ms_per_record": _scoring_s(a, reps) * 1e3,
            "reset_ms": reset_s * 1e3,
            "reprefill_ms": prefill_s * 1e3,
            "session_nbytes": nbytes,
            "active_memory_growth_bytes": grown,
            "active_memory_change_across_swaps_bytes": after - before,
        }
        if compare_mlx_lm:
            row["mlx_lm_cache_hit_ms"] = _mlx_lm_fetch(path, a, max(3, reps // 4)) * 1e3
        rows.append(row)
        del runner
    return {"slots": 2, "reps": reps, "rows": rows}
