"""The qmv kernel against ``mx.quantized_matmul``, product by product, on a CUDA GPU.

:mod:`turbospark.layers.cuda.qmv` replaces MLX's CUDA ``quantized_matmul``
for a decode step's products of packed weights. Here each product of a
gemma4 shape's sliding-window layers (q/k/v stacked, o, gate/up stacked,
down) and its head, at the ~8B ``tp8b`` shape (hidden 4096, MLP 14336,
vocabulary 32768) or the ~1B ``large`` one (``--size``), is timed both ways at 4 and 8
bits (affine, groups of 64, mlx-lm's default), one bfloat16 row (or
``--rows``), and reported as µs a product and the GB/s of what it reads and
writes (packed weight, scales, biases, x and y).

Each side runs a stream of products over enough copies of the weight that
they outgrow the H100's 50 MB L2 (so every product reads its weight from
memory, as a decode step does), built first and evaluated together: the
time is the stream's over its length, best of :data:`TRIALS`, the host's
encoding included where it is slower than the device. The two sides'
products must agree (the relative difference is reported) before either is
timed. Whole decode steps, where this shows as tok/s, are the ``quantized``
section (``python -m bench.run --device gpu --only quantized``).

Each product runs the kernel's variant for it
(:func:`~turbospark.layers.cuda.qmv.variant_for`), or, in a sweep, every
combination of the variant knobs given (outputs a warp, passes of loads in
flight, x staged in shared memory; ``--sweep`` alone: :data:`SWEEP`'s), each
against the same op timing. After the table it sums each variant's products
as a decode step spends them and ranks the variants per (bits, rows); a
sweep ends with the :data:`~turbospark.layers.cuda.qmv.TABLE` of the
fastest.

Run: ``uv run python -m bench.qmv [--size tp8b|large] [--bits 4 8] [--rows 1 8] [--group-size 64]
[--sweep] [--outs 1 2 4 8] [--unroll 1 2 4 8] [--shared-x 0 1] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from bench.common import SIZES
from turbospark.layers.cuda import qmv as qmv_cuda

SHAPE_SIZES = ("tp8b", "large")  # bench.common's gemma4 sizes a run may take


def products(size: str) -> dict[str, tuple[int, int]]:
    """(outputs, inputs) of a gemma4 size's products: a sliding-window
    layer's q/k/v stacked, o, gate/up stacked and down, and the head."""
    dims = SIZES["gemma4"][size]
    hidden, head_dim = dims["hidden_size"], dims["head_dim"]
    q, kv = dims["num_attention_heads"] * head_dim, dims["num_key_value_heads"] * head_dim
    mlp = dims["intermediate_size"]
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * mlp, hidden),
        "down": (hidden, mlp),
        "head": (dims["vocab_size"], hidden),
    }


# A sweep's knobs where a run names none (--sweep) or only some of them.
SWEEP = {"outs": list(qmv_cuda.OUTS), "unroll": [2, 4], "shared_x": [0, 1]}
STREAM_BYTES = 512 * 2**20  # the weight copies a stream cycles through: ten times the L2
TRIALS = 5


def _copies(
    outputs: int, width: int, bits: int, group_size: int, count: int
) -> list[tuple[mx.array, ...]]:
    weight = mx.random.normal((outputs, width), key=mx.random.key(outputs + bits)).astype(
        mx.bfloat16
    )
    packed = mx.quantize(weight * 0.05, group_size=group_size, bits=bits)
    copies = [tuple(a + 0 for a in packed) for _ in range(count)]  # each its own memory
    mx.eval(copies)
    return copies


def stream_us(product: Callable[..., mx.array], x: mx.array, copies: list[tuple], length: int) -> float:  # fmt: skip
    """µs a product of a stream of *length* products of *x* by each of
    *copies* in turn (``product(x, *copy)``), evaluated together; the best
    of :data:`TRIALS`, after one that builds and warms."""
    best = float("inf")
    for _ in range(TRIALS + 1):  # the first builds and warms
        outs = [product(x, *copies[i % len(copies)]) for i in range(length)]
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        best = min(best, time.perf_counter() - start)
    return best / length * 1e6


def variants(
    outs: list[int] | None, unrolls: list[int] | None, shared: list[int] | None
) -> list[qmv_cuda.Variant | None]:
    """The variants a run times: ``[None]`` (each product's own, from the
    table) unless a sweep's knob is given; a sweep is every combination, a
    knob not given taking :data:`SWEEP`'s values."""
    if outs is None and unrolls is None and shared is None:
        return [None]
    return [
        qmv_cuda.Variant(o, u, bool(x))
        for o in outs or SWEEP["outs"]
        for u in unrolls or SWEEP["unroll"]
        for x in (SWEEP["shared_x"] if shared is None else shared)
    ]


def bench_qmv(
    size: str = "tp8b",
    bits_list: tuple[int, ...] = qmv_cuda.BITS,
    rows_list: tuple[int, ...] = (1,),
    group_size: int = 64,
    variant_list: list[qmv_cuda.Variant | None] | None = None,
) -> list[dict[str, Any]]:
    """One row a (product, bits, rows, variant): each side's µs and GB/s, the
    kernel's speed-up, and the two products' largest difference relative to
    the largest output. The op is timed once a (product, bits, rows)."""
    mx.set_default_device(mx.gpu)
    results = []
    for bits in bits_list:
        for name, (outputs, width) in products(size).items():
            one = outputs * width * bits // 8 + 2 * outputs * width // group_size * 2
            copies = _copies(outputs, width, bits, group_size, max(2, -(-STREAM_BYTES // one)))
            length = 4 * len(copies)
            for rows in rows_list:
                x = mx.random.normal((rows, 1, width), key=mx.random.key(rows)).astype(mx.bfloat16)
                mx.eval(x)
                if not qmv_cuda.takes(x, *copies[0], group_size, bits, "affine"):
                    raise SystemExit(f"the kernel does not take {name} at {bits} bits, {rows} rows")
                op = qmv_cuda.qmv_ops(x, *copies[0], group_size, bits).astype(mx.float32)
                scale = mx.abs(op).max().item()
                op_us = stream_us(
                    lambda a, w, s, b, n=bits: qmv_cuda.qmv_ops(a, w, s, b, group_size, n),
                    x, copies, length,
                )  # fmt: skip
                moved = one + x.nbytes + rows * outputs * 2
                for variant in variant_list or [None]:
                    chosen = variant or qmv_cuda.variant_for(bits, rows)
                    kernel = qmv_cuda.qmv(x, *copies[0], group_size, bits, chosen)
                    difference = mx.abs(kernel.astype(mx.float32) - op).max().item() / scale
                    kernel_us = stream_us(
                        lambda a, w, s, b, n=bits, v=chosen: qmv_cuda.qmv(a, w, s, b, group_size, n, v),
                        x, copies, length,
                    )  # fmt: skip
                    results.append(
                        {
                            "product": name,
                            "outputs": outputs,
                            "inputs": width,
                            "bits": bits,
                            "group_size": group_size,
                            "rows": rows,
                            "variant": str(chosen),
                            "kernel_us": kernel_us,
                            "op_us": op_us,
                            "kernel_gb_s": moved / kernel_us / 1e3,
                            "op_gb_s": moved / op_us / 1e3,
                            "speedup": op_us / kernel_us,
                            "relative_difference": difference,
                        }
                    )
    return results


def step_us(
    results: list[dict[str, Any]], layers: int
) -> dict[tuple[int, int, str], tuple[float, float]]:
    """Each (bits, rows, variant)'s products as a decode step spends them
    (*layers* times q/k/v, o, gate/up and down, then the head once): the
    kernel's µs and the op's."""
    steps: dict[tuple[int, int, str], tuple[float, float]] = {}
    for r in results:
        key = (r["bits"], r["rows"], r["variant"])
        count = 1 if r["product"] == "head" else layers
        kernel, op = steps.get(key, (0.0, 0.0))
        steps[key] = (kernel + count * r["kernel_us"], op + count * r["op_us"])
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size", choices=SHAPE_SIZES, default="tp8b", help="the gemma4 shape whose products run"
    )
    parser.add_argument("--bits", type=int, nargs="+", default=list(qmv_cuda.BITS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument(
        "--outs", type=int, nargs="+", choices=qmv_cuda.OUTS, help="sweep: outputs a warp"
    )
    parser.add_argument(
        "--unroll", type=int, nargs="+", choices=qmv_cuda.UNROLLS, help="sweep: passes in flight"
    )
    parser.add_argument(
        "--shared-x", type=int, nargs="+", choices=(0, 1), help="sweep: x staged in shared memory"
    )
    parser.add_argument("--sweep", action="store_true", help=f"sweep every combination of {SWEEP}")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("bench.qmv needs MLX's CUDA backend: run it on a CUDA GPU")
    swept = variants(args.outs, args.unroll, args.shared_x)
    if args.sweep and swept == [None]:
        swept = variants(SWEEP["outs"], None, None)
    results = bench_qmv(args.size, tuple(args.bits), tuple(args.rows), args.group_size, swept)
    if args.json:
        print(json.dumps(results))
        return
    print("variant: outputs a warp, passes in flight, x in shared memory")
    print(
        "product     N x K          bits rows variant  kernel µs  GB/s   op µs  GB/s   x     rel diff"
    )
    for r in results:
        print(
            f"{r['product']:<10} {r['outputs']:>6} x {r['inputs']:<6} {r['bits']:>4} {r['rows']:>4}"
            f" {r['variant']:>7} {r['kernel_us']:>9.1f} {r['kernel_gb_s']:>6.0f} {r['op_us']:>7.1f}"
            f" {r['op_gb_s']:>5.0f} {r['speedup']:>5.2f}x {r['relative_difference']:.1e}"
        )
    layers = SIZES["gemma4"][args.size]["num_layers"]
    steps = step_us(results, layers)
    print(
        f"\na decode step's products ({layers} x (qkv + o + gate_up + down) + head), µs, fastest first"
    )
    best: dict[tuple[int, int], str] = {}
    for bits, rows in sorted({(b, r) for b, r, _ in steps}):
        ranked = sorted((k, v, o) for (b, r, v), (k, o) in steps.items() if (b, r) == (bits, rows))
        best[(bits, rows)] = ranked[0][1]
        line = "  ".join(f"{v} {k:.0f} ({o / k:.2f}x)" for k, v, o in ranked)
        print(f"bits {bits} rows {rows}: op {ranked[0][2]:.0f}  {line}")
    if len(swept) > 1:
        table = ", ".join(
            f"({b}, {r}): {qmv_cuda.parse_variant(v)!r}" for (b, r), v in best.items()
        )
        print(f"\nqmv.TABLE = {{{table}}}")


if __name__ == "__main__":
    main()
