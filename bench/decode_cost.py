"""What one decode step costs, beside its speed: the bandwidth roofline, the
graph it builds, and the host time spent building it.

- **Roofline.** Decode reads every weight once per token (a row of each
  embedding table is all it reads of those, unless the table is also the tied
  head). Weights bytes ÷ the device's copy bandwidth, measured in the same run
  by timing a large array copy, is the fastest a token can be; a decode rate
  divided by that is the fraction of the roofline reached.
- **Primitives per step.** MLX's own graph of one decode step (its sample and
  the state writes included), exported with ``mx.export_to_dot``; ``kernels``
  leaves out the primitives that are views (no kernel runs for them), so on a
  GPU it is a proxy for the kernel launches per step. On the CPU,
  ``mx.fast.rms_norm``/``rope``/attention have no fused kernel and expand into
  their element ops, so the CPU count is higher than the GPU's for both engines.
  ``gpu_kernels`` is the count the GPU sees, taken on the CPU with one-kernel
  stand-ins for those ops (:mod:`bench.gpu_kernels`; on a GPU, ``kernels``).
- **Host time per step.** Wall time to build one step's graph (the Python and
  graph work, nothing evaluated), the per-token cost a launch-bound device waits
  for, and the same as the thread's CPU time (``host_cpu_us_per_step``: what
  other processes' load moves least); medians over steps.
- **Overlap.** The share of a step still running when ``Runner.produce``
  (a lazy id, its sample queued with it) returns: what the host can spend
  building the next step while the device works. Near 0 means the loop does
  not pipeline at all. On the CPU MLX keeps only a few tasks in flight ahead
  of the host, so there it is a step's tail; on a GPU, most of the step.
- **Profile.** cProfile of ``stream_generate``'s decode, the top functions by
  own time (:func:`profile_decode`).

Each is measured with our compiled step, the same step with compilation off
(``mx.disable_compile()``: the uncompiled expressions) and mlx-lm's model.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import re
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from bench.gpu_kernels import gpu_kernels
from turbospark.generation.generate import GenerationConfig, stream_generate
from turbospark.generation.runner import Runner
from turbospark.text import load_text

# Primitives that are views or shape bookkeeping: no kernel runs for them.
VIEWS = frozenset(
    {"Broadcast", "Reshape", "Transpose", "Slice", "ExpandDims", "Squeeze", "Flatten",
     "Unflatten", "AsStrided", "StopGradient", "Split", "Depends"}
)  # fmt: skip


@contextmanager
def compile_off() -> Iterator[None]:
    """Run the forward as its plain, uncompiled expressions."""
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()


def copy_bandwidth(megabytes: int = 1024, reps: int = 10, copies: int = 4) -> float:
    """Bytes per second the default device moves copying a large array (each
    copy reads and writes it: two bytes moved per byte copied); best of *reps*.

    Each rep evaluates *copies* copies at once, so the sync that ends a rep is
    paid once per several copies: one 1 GiB copy a rep read 2.98-3.18 TB/s on
    the H200 where four read 3.29-3.44 over six rounds of both in one process,
    and a low denominator flatters every roofline fraction."""
    x = mx.random.uniform(shape=(megabytes * 2**18,))  # float32: 4 bytes each
    mx.eval(x)
    best = float("inf")
    for _ in range(reps + 1):  # the first one warms the allocator
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([mx.contiguous(x[::-1]) for _ in range(copies)])
        best = min(best, time.perf_counter() - start)
    return 2 * copies * x.nbytes / best


def weights_read_per_token(model: nn.Module, tied_head: nn.Module | None) -> int:
    """Bytes of weights one decode token reads: every parameter, less the
    embedding tables (one row each), plus *tied_head* read whole as the head."""
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    for _, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module is not tied_head:
            total -= module.weight.nbytes
    return total


def graph_primitives(outputs: list[mx.array], census: bool = False) -> dict[str, Any]:
    """Primitives in the unevaluated graph behind *outputs*: all, and kernels;
    with *census*, the kernels by primitive type too (most first; compiled
    kernels as ``Compiled``)."""
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "step.dot"
        mx.export_to_dot(str(dot), *outputs)
        labels = Counter(re.findall(r'label ="([^"]+)"', dot.read_text()))
    counts: dict[str, Any] = {
        "primitives": sum(labels.values()),
        "kernels": sum(n for name, n in labels.items() if name not in VIEWS),
        "compiled_kernels": sum(n for name, n in labels.items() if name.startswith("Compiled")),
    }
    if census:
        kinds: Counter[str] = Counter()
        for name, n in labels.items():
            if name not in VIEWS:
                kinds["Compiled" if name.startswith("Compiled") else name] += n
        counts["census"] = dict(kinds.most_common())
    return counts


Step = Callable[[int], list[mx.array]]


def _ours_step(runner: Runner, prompt: list[int]) -> Step:
    """One greedy decode step at a time through ``Runner.produce``'s forward."""
    runner.reset()
    runner.prefill_chunk(prompt, 0)

    def step(i: int) -> list[mx.array]:
        hook, live = runner._hook, runner.store.live  # the forward alone: no ids read back
        logits = hook.turbospark_forward(
            model=runner.model, tokens=mx.array([i % runner.vocab_size], mx.int32),
            start=live.position, state=live.state, vision=None, logits="last", steer=None,
        )  # fmt: skip
        return [mx.argmax(logits), *[a for c in live.state.values() for a in c.arrays()]]

    return step


def _theirs_step(model: nn.Module, prompt: list[int], vocab: int) -> Step:
    cache = model.make_cache()
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])

    def step(i: int) -> list[mx.array]:
        out = model(mx.array([[i % vocab]]), cache=cache)
        states = [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]
        return [mx.argmax(out[0, -1]), *states]

    return step


def _measure(step: Step, steps: int) -> dict[str, float]:
    """Host µs to build a step, wall and thread CPU (medians over *steps*,
    after 3 warm-ups), and the primitives of one step's graph."""
    for i in range(3):
        mx.eval(step(i))
    built, cpu = [], []
    for i in range(steps):
        start, began = time.perf_counter(), time.thread_time()
        outputs = step(i)
        cpu.append(time.thread_time() - began)
        built.append(time.perf_counter() - start)
        mx.eval(outputs)
    counts = graph_primitives(step(steps))
    return {
        "host_us_per_step": statistics.median(built) * 1e6,
        "host_cpu_us_per_step": statistics.median(cpu) * 1e6,
        **counts,
    }


def overlap(runner: Runner, prompt: list[int], steps: int = 24) -> float:
    """Median share of a pipelined step (``produce`` of a lazy id with its
    greedy sample) still running when ``produce`` returns."""
    runner.reset()
    pending = mx.argmax(runner.prefill_chunk(prompt, 0))
    position, left = len(prompt), []
    for _ in range(min(steps, runner.context_length - position - 1)):
        started = time.perf_counter()
        following = runner.produce(pending, position, then=mx.argmax)
        returned = time.perf_counter()
        mx.eval(following)
        left.append((time.perf_counter() - returned) / (time.perf_counter() - started))
        pending, position = following, position + 1
    return statistics.median(left)


def decode_cost(
    runner: Runner, model: nn.Module, prompt: list[int], steps: int = 24
) -> dict[str, Any]:
    """Host time and graph size per decode step: ours compiled and uncompiled,
    mlx-lm; and how much of our pipelined step overlaps the host."""
    vocab = runner.vocab_size
    result = {
        "ours": {
            **_measure(_ours_step(runner, prompt), steps),
            "overlap": overlap(runner, prompt, steps),
        }
    }
    with compile_off():
        result["ours_uncompiled"] = _measure(_ours_step(runner, prompt), steps)
    result["mlx_lm"] = _measure(_theirs_step(model, prompt, vocab), steps)
    runner.reset()
    if mx.default_device() == mx.gpu:
        gpu = {name: {"kernels": r["kernels"]} for name, r in result.items()}
    else:  # a fresh process, the fused ops' stand-ins installed before any trace
        gpu = gpu_kernels(runner.path)
    for name in result:  # the step's engines (gpu_kernels also counts verify passes)
        result[name]["gpu_kernels"] = gpu[name]["kernels"]
    return result


def profile_decode(
    runner: Runner, path: Path, prompt: list[int], decode: int, top: int = 25
) -> str:
    """cProfile of a ``stream_generate`` request (prefill excluded as far as the
    first token), the *top* functions by own time, as pstats prints them."""
    config = GenerationConfig(max_tokens=decode + 1, stop_token_ids=[], chunk_size=512)
    stream = stream_generate(runner, load_text(path), prompt, config)
    next(stream)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in stream:
        pass
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()
