"""Kernels one decode step launches on a GPU, counted on the CPU.

On a GPU, ``mx.fast.rms_norm``, ``rope`` and ``layer_norm`` are one
primitive (one kernel) each; on the CPU they have no fused kernel and expand,
when the graph is built, into their fallback's element ops, so the CPU's
``kernels`` (:func:`bench.decode_cost.graph_primitives`) runs about 3.5x the
GPU's. Here each is replaced, before anything is traced or compiled, by a
one-primitive stand-in of the same output shape that ``mx.compile`` does not
fuse (a ``cumsum``: one Scan), and the step's graph is counted as before:
MLX's graph of the GPU step, built on the CPU. The values it computes are
meaningless; nothing but the count is read.

``mx.fast.scaled_dot_product_attention`` is left as it is: the H200's counts
(MLX 0.32, ``python -m bench.run --device gpu --only forward``) match only with attention
expanded as the CPU expands it (a scale, two matmuls and a softmax: three
kernels more per attention layer than one fused op would be), so MLX's CUDA
backend runs these decode shapes through the same fallback. Checked at the
``host`` and ``large`` sizes in bfloat16: each count equal to the H200's.

The replacement is process-wide and must precede every trace, so
:func:`gpu_kernels` runs the count in a fresh interpreter
(``python -m bench.gpu_kernels --path INSTALL``), and :mod:`bench.decode_cost`
calls it for its ``gpu_kernels`` field (on a GPU that field is ``kernels``
itself).

Run: ``uv run python bench/gpu_kernels.py [--family F ...] [--size host] [--dtype bfloat16] [--census]
[--prefill ROWS TOKENS HELD] [--batch B] [--host] [--json]``; ``--prefill`` also counts a prefill group's
batched forward, ``--batch`` a batched decode step of B ragged rows (a server's).
``--host`` also times the host's part of building that graph, ours and mlx-lm's
(:func:`bench.decode_cost._measure`: medians over 48 steps, wall and thread CPU):
the GPU's step built on the CPU, so a change to how the step is built (not to its
kernels) can be compared without a GPU, each side in processes of its own.
``--census`` adds the step's non-view primitives by type: what to cut next.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]


def _stand_in(op: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """A one-kernel replacement for an ``mx.fast`` op that maps ``x`` to an
    array of its shape (a norm, RoPE): one Scan over ``x``. The op's other
    arrays are weights, frequency tables or the RoPE offset (leaves or a
    trace's inputs), so leaving them out of the graph drops no kernel."""

    def one_scan(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return mx.cumsum(x, axis=-1)

    one_scan.__doc__ = f"Stand-in for ``mx.fast.{op.__name__}`` (one kernel)."
    return one_scan


def install_stand_ins() -> None:
    """Replace the norms and RoPE (process-wide), and have our step take the
    forms it takes on a GPU, our CUDA kernels as stand-ins. MLX's attention
    op stays: its CUDA backend has no kernel for these decode shapes (head
    dims 256 and 512, grouped heads) and runs the same fallback the CPU builds
    (scale, matmul, softmax, matmul), which is what made mlx-lm's count match
    the H200's. Our lone row's decode step attends in its own two kernels
    (attention_cuda), which get a stand-in of two."""
    for name in ("rms_norm", "layer_norm", "rope"):
        setattr(mx.fast, name, _stand_in(getattr(mx.fast, name)))
    from turbospark.layers import fused
    from turbospark.layers.cuda import gdn as gdn_cuda

    fused.BUILD_FOR_GPU = True  # the step's GPU forms (turbospark.layers.fused.builds_for_gpu)
    # MLX's CUDA backend takes the one-kernel gated delta rule (gdn_cuda): so does the count.
    gdn_cuda.available = lambda: gdn_cuda.ENABLED
    gdn_cuda.gated_delta = _gated_delta_stand_in
    gdn_cuda.decode_mixer = _decode_mixer_stand_in
    # And the one-kernel residual joins with their norms (norm_cuda).
    from turbospark.layers.cuda import norm as norm_cuda

    norm_cuda.available = lambda: norm_cuda.ENABLED
    norm_cuda.join_norm = _join_norm_stand_in
    # And a decode step's attention as its two kernels (attention_cuda).
    from turbospark.layers.cuda import attention as attention_cuda

    attention_cuda.available = lambda: attention_cuda.ENABLED
    attention_cuda.decode = attention_cuda.decode_step = _decode_attention_stand_in
    # And the heads' norms and RoPE in one kernel (heads_cuda).
    from turbospark.layers.cuda import heads as heads_cuda

    heads_cuda.available = lambda: heads_cuda.ENABLED
    real_norm_rope = heads_cuda.norm_rope

    def norm_rope(x: mx.array, weight: mx.array, *args: Any) -> tuple[mx.array, ...]:
        if heads_cuda.takes(x, weight, args[0]):  # args[0]: RoPE's offset
            return _norm_rope_stand_in(x, weight, *args)
        return real_norm_rope(x, weight, *args)

    heads_cuda.norm_rope = norm_rope


def _decode_attention_stand_in(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    rows: mx.array,
    scale: float,
    left: mx.array | None = None,
) -> mx.array:
    """Two kernels, as :func:`turbospark.layers.cuda.attention.decode` is
    (a lone row's or, with *left*, a batch's): a Scan over the queries for
    the chunks' partial results, a second over those for their merge. The
    keys and values are the cache's buffers (evaluated with the state
    anyway) and the rows and first rows leaves, so leaving them out drops
    no kernel."""
    partial = mx.cumsum(queries, axis=-1)
    return mx.cumsum(partial, axis=-1)[..., : values.shape[-1]]


def _norm_rope_stand_in(
    x: mx.array,
    weight: mx.array,
    start: mx.array,
    freqs: mx.array,
    heads: int,
    kv_heads: int,
    eps: float,
) -> tuple[mx.array, ...]:
    """One kernel, as :func:`turbospark.layers.cuda.heads.norm_rope` is: a
    Scan over the projection, its heads views of it (the rest are leaves)."""
    batch, dim = x.shape[0], weight.shape[-1]
    out = mx.cumsum(x, axis=-1).reshape(batch, -1, 1, dim)
    if kv_heads == 0:
        return (out,)
    return out[:, :heads], out[:, heads : heads + kv_heads], out[:, -kv_heads:]


def _join_norm_stand_in(
    h: mx.array,
    update: mx.array,
    weight: mx.array | None,
    eps: float,
    update_weight: mx.array | None = None,
    scale: mx.array | None = None,
) -> tuple[mx.array, mx.array | None]:
    """One kernel, as :func:`turbospark.layers.cuda.norm.join_norm` is: a Scan
    over the update, both outputs. *h* is the stream some earlier kernel made
    (the embeddings' scale or an earlier join, whose other outputs are read
    anyway) and the rest are leaves, so leaving them out drops no kernel."""
    out = mx.cumsum(update, axis=-1)
    return out, None if weight is None else out


def _gated_delta_stand_in(
    mixed: mx.array, proj: mx.array, rate: mx.array, state: mx.array, key_heads: int,
    value_heads: int, key_head_dim: int, value_head_dim: int, a_offset: int, keep: bool = False,
) -> tuple[mx.array, ...]:  # fmt: skip
    """One kernel, as :func:`turbospark.layers.cuda.gdn.gated_delta` is: a Scan
    over the values for the outputs, the states broadcast views of them. The
    kernel's other inputs are the projection (computed anyway: the gated norm
    reads it) and leaves, so leaving them out of the graph drops no kernel."""
    batch, length, _ = mixed.shape
    values = mixed[..., 2 * key_heads * key_head_dim :]  # (B, T, Hv * Dv)
    out = mx.cumsum(values, axis=-1).reshape(batch, length, value_heads, value_head_dim)
    every = (batch, length, value_heads, value_head_dim, key_head_dim)
    last = mx.broadcast_to(out[:, -1, :, :, None], (batch, *every[2:]))
    return (out, last, mx.broadcast_to(out[..., None], every)) if keep else (out, last)


def _decode_mixer_stand_in(
    proj: mx.array, tail: mx.array, conv_weight: mx.array, in_bias: mx.array, rate: mx.array,
    state: mx.array, norm_weight: mx.array, key_heads: int, value_heads: int, key_head_dim: int,
    value_head_dim: int, eps: float,
) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    """One kernel, as :func:`turbospark.layers.cuda.gdn.decode_mixer` is: a Scan
    over the projection (the GEMM before it) for the output, the state and the
    tail broadcast views of it; the other inputs are leaves or earlier steps'
    outputs, so leaving them out drops no kernel."""
    batch = proj.shape[0]
    out = mx.cumsum(proj[..., : value_heads * value_head_dim], axis=-1)  # (B, 1, Hv * Dv)
    first = out[:, :, :1]
    return (
        out,
        mx.broadcast_to(first[..., None], state.shape),
        mx.broadcast_to(first, (batch, *tail.shape[1:])),
    )


def traced_pass(runner: Any, prompt: list[int], fed: int, census: bool = False) -> dict[str, Any]:
    """The graph of one lone row's traced pass of *fed* tokens after *prompt*
    (a draft's verify pass), as :meth:`Runner.verify
    <turbospark.generation.runner.Runner.verify>` runs it (its traced components told
    first), with every state array it leaves current (per-position states
    not asked for yet stay unbuilt). The second of two identical passes is counted, so
    compiled functions are traced already (what a GPU counts for a verify pass)."""
    from bench.decode_cost import graph_primitives

    for _ in range(2):
        runner.reset()
        runner.prefill_chunk(prompt, 0, logits=False)
        live = runner.sessions()[0]
        mx.eval([a for c in live.state.values() for a in c.arrays()])
        for component in runner.traced_components:
            live.state[component].trace()
        logits = runner._hook.turbospark_forward(
            model=runner.model, tokens=mx.array(prompt[:fed], mx.int32), start=len(prompt),
            state=live.state, vision=None, logits="all", steer=None,
        )  # fmt: skip
        arrays = [logits, *(a for c in live.state.values() for a in c.arrays())]
        counted = graph_primitives(arrays, census=census)
        mx.eval(arrays)
    runner.reset()
    return counted


def group_prefill(
    runner: Any, rows: int, length: int, held: int, census: bool = False
) -> dict[str, Any]:
    """The graph of one batched prefill forward (a server's prefill group):
    *rows* sessions holding *held* tokens each, merged, taking *length* more,
    as :func:`bench.prefill_cost.shapes` runs it. The second of two identical
    forwards is counted."""
    from bench.decode_cost import graph_primitives
    from bench.prefill_cost import held_group

    for _ in range(2):
        with held_group(runner, [[3 + i % 90 for i in range(held)]] * rows, length) as state:
            tokens = mx.array([[4 + (r + i) % 80 for i in range(length)] for r in range(rows)])
            logits = runner.forward_batch(tokens, [held] * rows, state, None)
            arrays = [logits, *(a for c in state.values() for a in c.arrays())]
            counted = graph_primitives(arrays, census=census)
            mx.eval(arrays)
    return counted


def count(
    path: Path,
    census: bool = False,
    depth: int = 4,
    prefill: tuple[int, int, int] | None = None,
    batch: int | None = None,
    host: bool = False,
) -> dict[str, Any]:
    """In this process (stand-ins installed first): the GPU-equivalent kernels
    of one decode step on *path*, ours compiled and uncompiled, and mlx-lm's;
    and ours for a verify pass of ``depth + 1`` tokens (:func:`traced_pass`)
    and, with *prefill* ``(rows, tokens, held)``, for a prefill group's
    forward (:func:`group_prefill`); with *batch*, for a batched decode step
    of that many ragged rows (:func:`batched_decode`); with *host*, each
    step's host time to build (``host``)."""
    install_stand_ins()
    from mlx_lm.utils import load_model

    from bench.decode_cost import _measure, _ours_step, _theirs_step, compile_off, graph_primitives
    from turbospark.generation.runner import Runner

    prompt = list(range(6, 38))  # 32 tokens: a decode step's graph is the same after any prompt
    runner = Runner.open(path, context_length=256)
    model, _ = load_model(path)
    steps = {"ours": _ours_step(runner, prompt)}
    steps["mlx_lm"] = _theirs_step(model, prompt, runner.vocab_size)
    out: dict[str, Any] = {}
    for name, step in steps.items():
        for warm in range(2):
            mx.eval(step(warm))
        out[name] = graph_primitives(step(2), census=census)
    if host:
        out["host"] = {name: _measure(step, 48) for name, step in steps.items()}
    with compile_off():
        step = _ours_step(runner, prompt)
        mx.eval(step(0))
        out["ours_uncompiled"] = graph_primitives(step(1), census=census)
    out["verify"] = traced_pass(runner, prompt, depth + 1, census)
    if prefill is not None:
        grouped = Runner.open(path, context_length=1024, session_slots=prefill[0] + 1)
        out["prefill"] = group_prefill(grouped, *prefill, census=census)
    if batch is not None:
        batched = Runner.open(path, context_length=1024, session_slots=batch + 1)
        out["batched_decode"] = batched_decode(batched, batch, 80, census=census)
    return out


def gpu_kernels(
    path: Path,
    census: bool = False,
    depth: int = 4,
    prefill: tuple[int, int, int] | None = None,
    batch: int | None = None,
    host: bool = False,
) -> dict[str, Any]:
    """:func:`count` in a fresh interpreter (the stand-ins must precede every trace)."""
    command = [sys.executable, "-m", "bench.gpu_kernels", "--path", str(path), "--json"]
    command += ["--depth", str(depth)]
    if prefill is not None:
        command += ["--prefill", *map(str, prefill)]
    if batch is not None:
        command += ["--batch", str(batch)]
    if host:
        command.append("--host")
    done = subprocess.run(
        command + (["--census"] if census else []),
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def batched_decode(runner: Any, rows: int, held: int, census: bool = False) -> dict[str, Any]:
    """The graph of one batched decode step (a server's, one token a row) of
    *rows* sessions holding *held*, *held* + 1, ... tokens: ragged, as a
    server's rows are, so the merged keys are left-padded and attention takes
    the padding mask. The second of two steps is counted: the step functions
    compiled per batch size are traced already, and its keys are one column
    longer, so its mask is built anew, as every step's is."""
    from bench.decode_cost import graph_primitives
    from bench.prefill_cost import held_group

    prompts = [[3 + (i + r) % 90 for i in range(held + r)] for r in range(rows)]
    with held_group(runner, prompts, 1) as state:
        mx.eval([a for c in state.values() for a in c.arrays()])  # the merge is not the step
        positions = [len(p) for p in prompts]
        tokens = mx.array([[4 + r % 80] for r in range(rows)])
        for step in range(2):
            if step:
                for component in state.values():
                    component.prepare(1)
            logits = runner.forward_batch(tokens, positions, state, None)
            arrays = [logits, *(a for c in state.values() for a in c.arrays())]
            if step:
                counted = graph_primitives(arrays, census=census)
            mx.eval(arrays)
            positions = [p + 1 for p in positions]
    return counted


def main() -> None:
    from bench.common import DEFAULT_CACHE, install

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", type=Path, help="an install (default: --family at --size)")
    parser.add_argument("--family", action="append", choices=["gemma4", "qwen_gdn"])
    parser.add_argument("--size", default="host", help="bench.common size (default: host)")
    parser.add_argument("--dtype", default="bfloat16", help="the install's dtype (the GPU's)")
    parser.add_argument("--census", action="store_true", help="primitives by type too")
    parser.add_argument("--depth", type=int, default=4, help="drafts in the verify pass (4)")
    parser.add_argument("--prefill", type=int, nargs=3, metavar=("ROWS", "TOKENS", "HELD"),
                        help="also a prefill group's forward (e.g. 3 145 80)")  # fmt: skip
    parser.add_argument("--batch", type=int, help="also a batched decode step of B ragged rows")
    parser.add_argument("--host", action="store_true", help="also time building the step")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    prefill = tuple(args.prefill) if args.prefill else None
    if args.path is not None:
        result: dict[str, Any] = count(
            args.path, args.census, args.depth, prefill, args.batch, args.host
        )
        print(json.dumps(result) if args.json else json.dumps(result, indent=1))
        return
    results = {}
    for family in args.family or ["gemma4", "qwen_gdn"]:
        path = install(family, args.size, args.dtype, DEFAULT_CACHE)
        results[family] = gpu_kernels(path, args.census, args.depth, prefill, args.batch, args.host)
    if args.json:
        print(json.dumps(results))
        return
    for family, result in results.items():
        host = result.pop("host", None)
        row = ", ".join(f"{name} {r['kernels']}" for name, r in result.items())
        print(f"{family} {args.size} {args.dtype}: GPU-equivalent kernels per pass: {row}")
        if args.census:
            for name, r in result.items():
                print(f"  {name}: {r['census']}")
        for name, r in (host or {}).items():
            wall, cpu = r["host_us_per_step"], r["host_cpu_us_per_step"]
            print(f"  {name} host µs to build a step: {wall:.0f} wall, {cpu:.0f} thread CPU")


if __name__ == "__main__":
    main()
