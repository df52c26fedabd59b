"""Decode steps much slower than the steady step: where they fall, and the first tokens after a prompt.

One process (run it fresh: what it measures includes the first traces):
open the install, prefill a prompt in chunks, then decode token by token,
reading each id back, so every step's time is its own. It reports the
median step, every step over twice it with its context length and the
full-attention buffers' capacity then, and the first 16 tokens' time;
with ``--mlx-lm``, mlx-lm's first 16 tokens after the same prompt in the
same process (after ours: its own first-call costs are its own).

On a GPU the attention kernels' step runs as it does for users. On the CPU
``--kernel-path`` takes that step with the kernels' contract in MLX ops
(:func:`~turbospark.layers.cuda.attention.decode_ops`, as the tests do), so
the tracing that step does per buffer capacity shows there too.

    uv run python -m bench.step_spikes PATH --prompt 4096 --decode 2000 --kernel-path
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from turbospark.generation.runner import Runner
from turbospark.layers import attention_step
from turbospark.layers.cuda import attention as attention_cuda
from turbospark.state.kv import KVComponent

FIRST = 16  # the tokens the first-tokens time counts
CHUNK = 512


def take_kernel_path() -> None:
    """The attention kernels' step with their contract in ops (the CPU's stand-in)."""
    attention_cuda.available = lambda: True  # type: ignore[assignment]
    attention_cuda.decode = attention_cuda.decode_ops  # type: ignore[assignment]
    attention_cuda.decode_step = mx.compile(attention_cuda.decode_ops)  # type: ignore[assignment]


def count_layer_traces() -> list[int]:
    """A counter of the attention layer steps' traces (the per-capacity
    ones: MLX runs a traced function's body only to trace it), from the
    next trace on; ``[count]``."""
    traced = [0]

    def counted(body: Any) -> Any:
        def traces(*args: Any) -> Any:
            traced[0] += 1
            return body(*args)

        return traces

    attention_step.owner_layer = counted(attention_step.owner_layer)  # type: ignore[assignment]
    attention_step.shared_layer = counted(attention_step.shared_layer)  # type: ignore[assignment]
    attention_step.owner_trace.cache_clear()
    attention_step.shared_trace.cache_clear()
    return traced


def _capacity(runner: Runner) -> int:
    """The full-attention buffers' capacity (the first such layer's)."""
    for component in runner.store.live.state.values():
        if isinstance(component, KVComponent) and component.window is None:
            keys = component.layers[0].keys
            if keys is not None:
                return keys.shape[2]
    return 0


def ours(path: Path, prompt: list[int], decode: int) -> dict[str, Any]:
    traced = count_layer_traces()
    started = time.perf_counter()
    runner = Runner.open(path, context_length=len(prompt) + decode + 1)
    opened, at_open = time.perf_counter() - started, traced[0]
    for begin in range(0, len(prompt), CHUNK):
        end = min(begin + CHUNK, len(prompt))
        logits = runner.prefill_chunk(prompt[begin:end], begin, logits=end == len(prompt))
    token = int(mx.argmax(logits).item())
    at_prompt = traced[0]
    steps, host, capacities, traces = [], [], [], []
    for i in range(decode):
        start, began, before = time.perf_counter(), time.thread_time(), traced[0]
        token = int(mx.argmax(runner.produce(token, len(prompt) + i)).item())
        host.append(time.thread_time() - began)
        steps.append(time.perf_counter() - start)
        capacities.append(_capacity(runner))
        traces.append(traced[0] - before)
    median, host_median = statistics.median(steps), statistics.median(host)
    slow = [
        {
            "context": len(prompt) + i,
            "capacity": capacities[i],
            "ms": t * 1e3,
            "x": t / median,
            "host_x": host[i] / host_median,
            "traces": traces[i],
        }
        for i, t in enumerate(steps)
        if t > 2 * median or host[i] > 2 * host_median or traces[i]
    ]
    return {
        "open_s": opened,
        "traces_at_open": at_open,
        "traces_in_prompt": at_prompt - at_open,
        "traces_in_decode": sum(traces),
        "median_ms": median * 1e3,
        "host_median_ms": host_median * 1e3,
        "first_ms": sum(steps[:FIRST]) * 1e3,
        "slow_steps": slow,
    }


def theirs(path: Path, prompt: list[int]) -> float:
    """mlx-lm's first :data:`FIRST` tokens after *prompt*, ms."""
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    cache = model.make_cache()
    for begin in range(0, len(prompt), CHUNK):
        out = model(mx.array(prompt[begin : begin + CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])
    token = int(mx.argmax(out[0, -1]).item())
    start = time.perf_counter()
    for _ in range(FIRST):
        token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]).item())
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "path", type=Path, help="an install (a synthetic one: bench.common.install)"
    )
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=1000)
    parser.add_argument("--kernel-path", action="store_true", help="CPU: the kernels' step in ops")
    parser.add_argument("--mlx-lm", action="store_true", help="mlx-lm's first tokens too")
    args = parser.parse_args(argv)
    if args.kernel_path:
        take_kernel_path()
    prompt = [3 + (7 * i) % 90 for i in range(args.prompt)]
    result = ours(args.path, prompt, args.decode)
    if args.mlx_lm:
        result["mlx_lm_first_ms"] = theirs(args.path, prompt)
    print(
        f"open {result['open_s']:.2f} s, median step {result['median_ms']:.2f} ms "
        f"(host {result['host_median_ms']:.2f}), first "
        f"{FIRST} tokens {result['first_ms']:.1f} ms"
        + (f" (mlx-lm {result['mlx_lm_first_ms']:.1f} ms)" if args.mlx_lm else "")
    )
    print(
        f"layer-step traces: {result['traces_at_open']} at open, "
        f"{result['traces_in_prompt']} in the prompt, {result['traces_in_decode']} in decode"
    )
    for step in result["slow_steps"]:
        print(
            f"  context {step['context']}: {step['ms']:.1f} ms ({step['x']:.1f}x; host "
            f"{step['host_x']:.1f}x), capacity {step['capacity']}, layer traces {step['traces']}"
        )
    return result


if __name__ == "__main__":
    main()
