"""Activation steering's decode cost: every layer steered against steering off.

Three runners on the same weights, interleaved so load drift hits each alike:
``off`` (no vector: the families run no extra op), ``add`` and ``renorm`` (the
cheapest and the dearest mode) with a vector on every steerable layer. Each
decodes the same tokens through :meth:`Runner.produce`, the sampled id kept
lazy as the generation loop does, after the same prefill. The target
is ``decode_ratio`` >= 0.97 for every mode.
Medians and bests are both reported, with the run-to-run spread of each engine,
and the median of the ratios inside each rep (``paired_decode_ratio``: each
rep runs every engine back to back, which cancels drift between reps). Also
the calling thread's CPU time per token (``host_ms_per_token``, and its least
over the reps, ``best_host_ratio``): where a step is bound by building and
launching its kernels (a GPU's decode), that is most of its cost, and it moves
far less with other load than wall time does. And the host time to build one
steered layer's decode tail, folded against the two calls it replaced
(``layer_host_us``).

    uv run python bench/steering.py [--family F] [--size small] [--tokens 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

if __package__ in (None, ""):
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
from bench.decode_cost import graph_primitives
from turbospark.contract.protocols import Parts
from turbospark.generation.runner import Runner
from turbospark.policies.steering import Steer, SteeringPolicy, joiner

PROMPT = 32
MODES = ("add", "renorm")


def every_layer(runner: Runner, mode: str) -> SteeringPolicy:
    """A random vector on every layer llama.cpp can steer (1 .. n-1), small
    enough that decoding stays on the model's own distribution."""
    rng = np.random.default_rng(0)
    width, layers = runner.arch.hidden_size, runner.arch.num_hidden_layers
    return SteeringPolicy.from_directions(
        {k: 0.05 * rng.standard_normal(width).astype(np.float32) for k in range(1, layers)},
        scale=1.0,
        mode=mode,
    )


def step_kernels(path: Path) -> dict[str, dict[str, int]]:
    """Kernels (MLX graph primitives that are not views) in one decode step:
    unsteered, steered as the families run it (the join handed over,
    :func:`turbospark.policies.steering.joiner`), and through a plain ``steer(i, h)``
    hook after each layer. Exact, and independent of load; on the CPU
    ``rms_norm`` expands into element ops that fuse with a join, so CPU counts
    differ from a GPU's."""
    runner = Runner.open(path, context_length=PROMPT + 4)
    prompt = random_tokens(PROMPT, runner.arch.vocab_size, seed=5)
    counts: dict[str, dict[str, int]] = {}
    for mode in MODES:
        steer = Steer.of([every_layer(runner, mode)], runner.dtype)
        hooks = {"off": None, "joined": steer, "plain_hook": lambda i, h, s=steer: s(i, h)}
        counts[mode] = {}
        for name, hook in hooks.items():
            runner.reset()
            runner.prefill_chunk(prompt, 0, logits=False)
            live = runner.store.live
            mx.eval([a for c in live.state.values() for a in c.arrays()])
            logits = runner._hook.turbospark_forward(
                model=runner.model, tokens=mx.array([5], mx.int32), start=PROMPT,
                state=live.state, vision=None, logits="last", steer=hook,
            )  # fmt: skip
            counts[mode][name] = graph_primitives([logits])["kernels"]
    return counts


def _layer_tail(runner: Runner) -> tuple[Parts, Callable[..., mx.array], tuple, mx.array | None]:
    """The family's compiled tail for one decode token of layer 1 at this
    install's dimensions (weights random: only building is timed): the part up
    to the last join, the whole unsteered step, its arguments, the join's scale."""
    arch, dtype = runner.arch, runner.dtype

    def a(*shape: int) -> mx.array:
        return mx.random.normal(shape).astype(dtype)

    from turbospark.layers.layer_end import parts, tail_step

    hidden, eps = arch.hidden_size, arch.rms_norm_eps
    if runner.family.name == "gemma4":
        inner, ple = arch.layer_intermediate_size(1), arch.hidden_size_per_layer_input
        dense = (a(hidden), a(hidden), a(hidden, 2 * inner), a(inner, hidden), a(hidden))
        block = (a(hidden, ple), a(ple, hidden), a(hidden)) if ple else None
        weights = (*dense, block, a(1))
        args = (a(1, 1, hidden), a(1, 1, hidden), a(1, 1, ple) if ple else None, weights, eps, True)
        return parts, tail_step, args, weights[6]
    inner = arch.intermediate_size
    weights = (None, a(hidden), a(hidden, 2 * inner), a(inner, hidden), None, None, None)
    # the residual stream after the mixer
    args = (a(1, 1, hidden), None, None, weights, eps, False)
    return parts, tail_step, args, None


def layer_host_us(runner: Runner, builds: int = 2000) -> dict[str, dict[str, float]]:
    """Host time to build one steered layer's decode tail, in µs, the least of
    *builds* (nothing is evaluated; the least is what other load did not add
    to): ``off`` the family's unsteered compiled tail, ``folded`` the tail and
    the steering as one compiled call (:meth:`turbospark.policies.steering.Join.fold`),
    ``two_calls`` the path the fold replaced (the tail compiled alone, then the
    steering's joined kernel)."""
    parts, whole, args, scale = _layer_tail(runner)
    mx.eval(args, scale)
    tail = mx.compile(parts)

    def least(build: Callable[[], mx.array]) -> float:
        build()  # traced once
        times = []
        for _ in range(builds):
            start = time.perf_counter()
            build()
            times.append(time.perf_counter() - start)
        return round(1e6 * min(times), 2)

    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        steer = Steer.of([every_layer(runner, mode)], runner.dtype)
        join = joiner(steer, 1)
        out[mode] = {
            "off": least(lambda: whole(*args)),
            "folded": least(lambda j=join: j.fold(parts, args, scale, compiled=True)),
            "two_calls": least(lambda j=join: j(*tail(*args), scale)),
        }
    return out


def bench_steering(path: Path, tokens: int, reps: int) -> dict[str, Any]:
    context = PROMPT + tokens + 2
    runners = {"off": Runner.open(path, context_length=context)}
    for mode in MODES:
        runners[mode] = Runner.open(
            path, context_length=context, steering=every_layer(runners["off"], mode)
        )
    prompt = random_tokens(PROMPT, runners["off"].arch.vocab_size, seed=5)

    def decode(runner: Runner) -> dict[str, float]:
        runner.reset()
        token = mx.argmax(runner.prefill_chunk(prompt, 0))
        mx.eval(token)
        start, host = time.perf_counter(), time.thread_time()
        for i in range(tokens):
            token = mx.argmax(runner.produce(token, PROMPT + i))  # stays lazy, as generation
        mx.eval(token)
        return {
            "decode_tok_s": tokens / (time.perf_counter() - start),
            "host_ms_per_token": 1e3 * (time.thread_time() - host) / tokens,
        }

    rows = interleaved({name: (lambda r=r: decode(r)) for name, r in runners.items()}, reps)
    off = median_of(rows["off"], "decode_tok_s")
    result: dict[str, Any] = {
        "layers_steered": runners["off"].arch.num_hidden_layers - 1,
        "decode_tokens": tokens,
        "reps": reps,
        "engines": {
            name: {
                "decode_tok_s": median_of(samples, "decode_tok_s"),
                "best_decode_tok_s": max(s["decode_tok_s"] for s in samples),
                "spread": _spread([s["decode_tok_s"] for s in samples]),
                "host_ms_per_token": median_of(samples, "host_ms_per_token"),
                "best_host_ms_per_token": min(s["host_ms_per_token"] for s in samples),
            }
            for name, samples in rows.items()
        },
    }
    result["kernels_per_step"] = step_kernels(path)
    result["layer_host_us"] = layer_host_us(runners["off"])
    best_off = result["engines"]["off"]["best_decode_tok_s"]
    for mode in MODES:
        result[f"decode_ratio_{mode}"] = median_of(rows[mode], "decode_tok_s") / off
        # Best against best: what the machine's load took least from (noisy hosts).
        result[f"best_decode_ratio_{mode}"] = (
            result["engines"][mode]["best_decode_tok_s"] / best_off
        )
        # Each rep runs every engine back to back, so the ratio inside a rep
        # cancels drift that moves all of them (clocks, other load) between reps.
        result[f"paired_decode_ratio_{mode}"] = statistics.median(
            m["decode_tok_s"] / o["decode_tok_s"]
            for m, o in zip(rows[mode], rows["off"], strict=True)
        )
        # Host CPU time per token, off over steered, paired the same way.
        result[f"paired_host_ratio_{mode}"] = statistics.median(
            o["host_ms_per_token"] / m["host_ms_per_token"]
            for m, o in zip(rows[mode], rows["off"], strict=True)
        )
        # Least against least: other load only ever adds host time (cache and
        # core contention), so each engine's fastest rep is its nearest to quiet.
        result[f"best_host_ratio_{mode}"] = (
            result["engines"]["off"]["best_host_ms_per_token"]
            / result["engines"][mode]["best_host_ms_per_token"]
        )
    return result


def _spread(values: list[float]) -> float:
    """(max - min) / median: the run-to-run spread, reported beside every median."""
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", action="append", choices=["gemma4", "qwen_gdn"])
    parser.add_argument("--size", default="small")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    dtype = args.dtype or default_dtype()
    report: dict[str, Any] = {"machine": machine(), "size": args.size, "dtype": dtype}
    for family in args.family or ["gemma4", "qwen_gdn"]:
        path = install(family, args.size, dtype, args.cache_dir)
        report[family] = bench_steering(path, args.tokens, args.reps)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
