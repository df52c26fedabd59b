"""The few-row float product's kernel against MLX's matmul (cuBLASLt), product by product, on a CUDA GPU.

:mod:`turbospark.layers.cuda.fmv` takes a float product of 2 to 16 rows
(a batched decode step's) from cuBLASLt. Here each of the ``large`` gemma4
shape's products (hidden 2048, MLP 8192: q/k/v stacked, o, gate/up stacked,
down) is timed both ways in bfloat16 at ``--rows`` rows, two figures each:

- ``device_us``: a stream of products over enough copies of the weight to
  outgrow the L2 (each product reads its weight from memory, as a decode
  step does), evaluated together, over its length; best of
  :data:`bench.qmv.TRIALS` (:func:`bench.qmv.stream_us`).
  Where the host encodes slower than the device runs, this is the host's.
- ``host_us``: the host time to build and encode one product (its graph
  node and MLX's evaluation call), one product at a time, median.

The two sides' products must agree (the relative difference is reported)
before either is timed. Whole decode steps are ``bench/step_cost.py`` with
``TURBOSPARK_FMV_KERNEL=0`` and ``1``.

Run: ``python3 -m bench.fmv [--rows 2 8 16] [--tiles 1 2 4] [--json]``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from bench.qmv import stream_us
from turbospark.layers.cuda import fmv as fmv_cuda

# (outputs, inputs) of the large gemma4 shape's products.
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
STREAM_BYTES = 512 * 2**20  # the weight copies a stream cycles through: ten times the L2
ENCODES = 200  # products timed one at a time for the host's figure


def _host_us(product: Any, x: mx.array, weight_t: mx.array) -> float:
    spent = []
    for _ in range(ENCODES):
        start = time.perf_counter()
        out = product(x, weight_t)
        mx.async_eval(out)
        spent.append(time.perf_counter() - start)
    mx.synchronize()
    return statistics.median(spent[ENCODES // 4 :]) * 1e6


def bench_fmv(
    rows_list: tuple[int, ...] = (2, 8, 16), tiles_list: tuple[int, ...] = (fmv_cuda.TILES,)
) -> list[dict[str, Any]]:
    """One row a (product, rows, tiles): each side's device and host µs, the
    kernel's GB/s of weight, and the products' largest difference relative
    to the largest output."""
    mx.set_default_device(mx.gpu)
    theirs = fmv_cuda.fmv_ops
    results = []
    for name, (outputs, width) in SHAPES.items():
        weight = mx.random.normal((outputs, width), key=mx.random.key(outputs)) * width**-0.5
        weight = weight.astype(mx.bfloat16)
        count = max(2, -(-STREAM_BYTES // weight.nbytes))
        copies = [((weight + 0).T,) for _ in range(count)]  # each its own memory, read transposed
        mx.eval(copies)
        for rows, tiles in itertools.product(rows_list, tiles_list):
            x = mx.random.normal((rows, 1, width), key=mx.random.key(rows)).astype(mx.bfloat16)
            mx.eval(x)
            if not fmv_cuda.fits(x, copies[0][0]):
                raise SystemExit(f"the kernel does not take {name} at {rows} rows")
            kernel = functools.partial(fmv_cuda.fmv, tiles=tiles)
            op = theirs(x, copies[0][0]).astype(mx.float32)
            difference = (mx.abs(kernel(x, copies[0][0]).astype(mx.float32) - op).max() / mx.abs(op).max()).item()  # fmt: skip
            row = {
                "product": name,
                "outputs": outputs,
                "inputs": width,
                "rows": rows,
                "tiles": tiles,
            }
            for side, product in (("kernel", kernel), ("cublas", theirs)):
                row[f"{side}_device_us"] = stream_us(product, x, copies, 4 * count)
                row[f"{side}_host_us"] = _host_us(product, x, copies[0][0])
            row["kernel_gb_s"] = weight.nbytes / row["kernel_device_us"] / 1e3
            row["relative_difference"] = difference
            results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument(
        "--tiles", type=int, nargs="+", default=[fmv_cuda.TILES], help="tiles of 8 outputs a warp"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = bench_fmv(tuple(args.rows), tuple(args.tiles))
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'product':8} {'rows':>4} {'tiles':>5} {'kernel µs':>10} {'cuBLAS µs':>10} {'host µs (k / c)':>16} {'GB/s':>6} {'diff':>8}")  # fmt: skip
    for r in results:
        print(
            f"{r['product']:8} {r['rows']:>4} {r['tiles']:>5} {r['kernel_device_us']:>10.1f} {r['cublas_device_us']:>10.1f}"
            f" {r['kernel_host_us']:>7.1f} / {r['cublas_host_us']:<6.1f} {r['kernel_gb_s']:>6.0f}"
            f" {r['relative_difference']:>8.1e}"
        )


if __name__ == "__main__":
    main()
