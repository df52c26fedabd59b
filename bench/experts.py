"""The routed-expert cache: decode speed, hit rate and memory against slot count.

One gemma4 MoE install whose experts are most of its weights (``moe`` on the
CPU, ``moe_large`` on a GPU: see ``bench/common.py``) is opened once per
policy: ``ExpertCacheSlots.fixed`` at top_k, 2·top_k and 4·top_k slots per
layer, and ``all()`` (every expert resident, the path every MoE install took
before the cache existed). Each runner prefills the same prompt and greedy
decodes the same tokens, interleaved across reps so load drift hits every
policy alike; the runners are checked to emit the same tokens.

Per policy: decode tok/s (median of reps), hit rate and expert bytes read per
decoded token (decode only, from ``Runner.expert_cache_stats``), the expert
bytes resident, and the growth of MLX's active memory when the runner opened.
Random weights route close to uniformly, so hit rates here are a floor: a
trained router reuses experts far more.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so `bench.*` resolves.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    DEFAULT_CACHE,
    default_dtype,
    install,
    interleaved,
    machine,
    median_of,
    random_tokens,
)
from turbospark.generation.runner import Runner
from turbospark.loading.install import peek_manifest_arch
from turbospark.policies import ExpertCacheSlots

Sample = dict[str, float]


def policies(top_k: int, num_experts: int) -> dict[str, ExpertCacheSlots]:
    """top_k, 2·top_k, 4·top_k (those below num_experts) and all."""
    fixed = {f"fixed({n})": ExpertCacheSlots.fixed(n) for n in (top_k, 2 * top_k, 4 * top_k)}
    chosen = {name: p for name, p in fixed.items() if (p.slots or 0) < num_experts}
    return {**chosen, "all": ExpertCacheSlots.all()}


def _loop(
    runner: Runner, prompt: list[int], decode: int, tokens: list[int]
) -> Callable[[], Sample]:
    def run() -> Sample:
        runner.reset()
        start = time.perf_counter()
        token = int(mx.argmax(runner.prefill_chunk(prompt, 0)).item())
        prefilled, cpu = time.perf_counter(), time.process_time()
        before = runner.expert_cache_stats()
        out = []
        for i in range(decode):
            token = int(mx.argmax(runner.produce(token, len(prompt) + i)).item())
            out.append(token)
        decoded, cpu = time.perf_counter(), time.process_time() - cpu
        after = runner.expert_cache_stats()
        tokens[:] = out
        assert before is not None and after is not None
        hits, misses = after.hits - before.hits, after.misses - before.misses
        return {
            "prefill_s": prefilled - start,
            "decode_s": decoded - prefilled,
            "decode_cpu_s": cpu,
            "hits": hits,
            "misses": misses,
            "bytes_read": after.bytes_read - before.bytes_read,
        }

    return run


def bench_experts(path: Path, prompt_tokens: int, decode_tokens: int, reps: int) -> dict[str, Any]:
    arch = peek_manifest_arch(path)
    top_k, num_experts = arch.top_k_experts, arch.num_experts
    prompt = random_tokens(prompt_tokens, arch.vocab_size, seed=16)
    context = prompt_tokens + decode_tokens + 8
    runners: dict[str, Runner] = {}
    opened: dict[str, int] = {}
    for name, policy in policies(top_k, num_experts).items():
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        runners[name] = Runner.open(path, context_length=context, expert_cache=policy)
        opened[name] = mx.get_active_memory() - before
    emitted: dict[str, list[int]] = {name: [] for name in runners}
    samples = interleaved(
        {name: _loop(r, prompt, decode_tokens, emitted[name]) for name, r in runners.items()}, reps
    )
    reference = emitted["all"]
    engines: dict[str, Any] = {}
    for name, rows in samples.items():
        stats = runners[name].expert_cache_stats()
        assert stats is not None
        looked = sum(r["hits"] + r["misses"] for r in rows)
        engines[name] = {
            "slots_per_layer": stats.slots_per_layer,
            "decode_tok_s": decode_tokens / median_of(rows, "decode_s"),
            "decode_tok_s_spread": [
                decode_tokens / max(r["decode_s"] for r in rows),
                decode_tokens / min(r["decode_s"] for r in rows),
            ],
            # CPU seconds of this process: steadier than wall time on a shared machine.
            "decode_tok_per_cpu_s": decode_tokens / median_of(rows, "decode_cpu_s"),
            "prefill_tok_s": prompt_tokens / median_of(rows, "prefill_s"),
            "hit_rate": sum(r["hits"] for r in rows) / looked if looked else 1.0,
            "bytes_read_per_token": sum(r["bytes_read"] for r in rows)
            / (decode_tokens * len(rows)),
            "resident_expert_bytes": stats.resident_bytes,
            "active_memory_at_open_bytes": opened[name],
            "same_tokens_as_all": emitted[name] == reference,
        }
    full = engines["all"]
    for row in engines.values():
        row["decode_vs_all"] = row["decode_tok_s"] / full["decode_tok_s"]
        row["decode_cpu_vs_all"] = row["decode_tok_per_cpu_s"] / full["decode_tok_per_cpu_s"]
        row["resident_fraction"] = row["resident_expert_bytes"] / full["resident_expert_bytes"]
    return {
        "install": path.name,
        "num_experts": num_experts,
        "top_k": top_k,
        "layers": arch.num_hidden_layers,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "reps": reps,
        "engines": engines,
    }


def print_experts(result: dict[str, Any]) -> None:
    print(
        f"experts: {result['install']} ({result['layers']} layers, {result['num_experts']} experts, "
        f"top {result['top_k']}), decode {result['decode_tokens']} tokens x {result['reps']} reps"
    )
    print(f"{'policy':>10} {'tok/s':>8} {'vs all':>7} {'tok/cpu-s':>9} {'vs all':>7} {'hit':>5} {'MiB read/tok':>13} "
          f"{'resident MiB':>13} {'opened MiB':>11} same")  # fmt: skip
    for name, row in result["engines"].items():
        print(
            f"{name:>10} {row['decode_tok_s']:8.1f} {row['decode_vs_all']:7.3f} "
            f"{row['decode_tok_per_cpu_s']:9.1f} {row['decode_cpu_vs_all']:7.3f} "
            f"{row['hit_rate']:5.0%} {row['bytes_read_per_token'] / 2**20:13.2f} "
            f"{row['resident_expert_bytes'] / 2**20:13.1f} "
            f"{row['active_memory_at_open_bytes'] / 2**20:11.1f} {row['same_tokens_as_all']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="moe", help="moe (CPU) or moe_large (GPU)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dtype = args.dtype or default_dtype()
    out = bench_experts(install("gemma4", args.size, dtype, args.cache_dir),
                        args.prompt_tokens, args.decode_tokens, args.reps)  # fmt: skip
    if args.json:
        print(json.dumps({"machine": machine(), "dtype": dtype, **out}, indent=2))
    print_experts(out)


if __name__ == "__main__":
    main()
