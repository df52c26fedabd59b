"""The qmv kernel against ``mx.quantized_matmul``, product by product, on a CUDA GPU.

:mod:`turbospark.layers.cuda.qmv` replaces MLX's CUDA ``quantized_matmul``
for a decode step's products of packed weights. Here each of the ~8B
gemma4 shape's products (hidden 4096, MLP 14336, vocabulary 32768: q/k/v
stacked, o, gate/up stacked, down, the head) is timed both ways at 4 and 8
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

Run: ``uv run python -m bench.qmv [--bits 4 8] [--rows 1 8] [--group-size 64] [--json]``.
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

from turbospark.layers.cuda import qmv as qmv_cuda

# (outputs, inputs) of the ~8B gemma4 shape's products.
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "head": (32768, 4096),
}
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


def _stream_us(product: Callable[..., mx.array], x: mx.array, copies: list[tuple], length: int) -> float:  # fmt: skip
    best = float("inf")
    for _ in range(TRIALS + 1):  # the first builds and warms
        outs = [product(x, *copies[i % len(copies)]) for i in range(length)]
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        best = min(best, time.perf_counter() - start)
    return best / length * 1e6


def bench_qmv(
    bits_list: tuple[int, ...] = qmv_cuda.BITS,
    rows_list: tuple[int, ...] = (1,),
    group_size: int = 64,
) -> list[dict[str, Any]]:
    """One row a (product, bits, rows): each side's µs and GB/s, the kernel's
    speed-up, and the two products' largest difference relative to the largest output."""
    mx.set_default_device(mx.gpu)
    results = []
    for bits in bits_list:
        for name, (outputs, width) in SHAPES.items():
            one = outputs * width * bits // 8 + 2 * outputs * width // group_size * 2
            copies = _copies(outputs, width, bits, group_size, max(2, -(-STREAM_BYTES // one)))
            for rows in rows_list:
                x = mx.random.normal((rows, 1, width), key=mx.random.key(rows)).astype(mx.bfloat16)
                mx.eval(x)
                if not qmv_cuda.takes(x, *copies[0], group_size, bits, "affine"):
                    raise SystemExit(f"the kernel does not take {name} at {bits} bits, {rows} rows")
                kernel = qmv_cuda.qmv(x, *copies[0], group_size, bits).astype(mx.float32)
                op = qmv_cuda.qmv_ops(x, *copies[0], group_size, bits).astype(mx.float32)
                scale = mx.abs(op).max().item()
                difference = mx.abs(kernel - op).max().item() / scale
                length = 4 * len(copies)
                timed = {}
                for side, product in (("kernel", qmv_cuda.qmv), ("op", qmv_cuda.qmv_ops)):
                    timed[side] = _stream_us(
                        lambda a, w, s, b, p=product, n=bits: p(a, w, s, b, group_size, n),
                        x, copies, length,
                    )  # fmt: skip
                moved = one + x.nbytes + rows * outputs * 2
                results.append(
                    {
                        "product": name,
                        "outputs": outputs,
                        "inputs": width,
                        "bits": bits,
                        "group_size": group_size,
                        "rows": rows,
                        "kernel_us": timed["kernel"],
                        "op_us": timed["op"],
                        "kernel_gb_s": moved / timed["kernel"] / 1e3,
                        "op_gb_s": moved / timed["op"] / 1e3,
                        "speedup": timed["op"] / timed["kernel"],
                        "relative_difference": difference,
                    }
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, nargs="+", default=list(qmv_cuda.BITS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("bench.qmv needs MLX's CUDA backend: run it on a CUDA GPU")
    results = bench_qmv(tuple(args.bits), tuple(args.rows), args.group_size)
    if args.json:
        print(json.dumps(results))
        return
    print("product     N x K          bits rows  kernel µs  GB/s   op µs  GB/s   x     rel diff")
    for r in results:
        print(
            f"{r['product']:<10} {r['outputs']:>6} x {r['inputs']:<6} {r['bits']:>4} {r['rows']:>4}"
            f" {r['kernel_us']:>9.1f} {r['kernel_gb_s']:>6.0f} {r['op_us']:>7.1f}"
            f" {r['op_gb_s']:>5.0f} {r['speedup']:>5.2f}x {r['relative_difference']:.1e}"
        )


if __name__ == "__main__":
    main()
