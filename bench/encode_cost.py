"""MLX's own host time per op: what handing one product (or one kernel) to the device costs.

A decode step on a GPU is bound by the host, and most of a batched step's host
time is inside MLX's evaluation call (docs/CUDA.md). This times that call per
op, with nothing of ours around it: *n* independent ops are built, then
``mx.async_eval`` hands them to the device, and the call's time over *n* is
the op's encoding (on CUDA: its kernel node, or for a float product of more
than one row, cuBLASLt's descriptors, its heuristic query and the call's
capture). The wall time to the results, over *n*, says what the device adds.

Ops, each at ``--rows`` rows (a server's batch) over a ``--width`` x
``--outputs`` weight: ``matmul`` (``x @ w.T``), ``addmm`` (a product with a
residual added, as a batched step's ``AddMM``), ``elementwise`` (one
multiply); on CUDA also ``custom`` (a trivial kernel built and launched as
ours are, :class:`turbospark.layers.cuda.kernel.Kernel`). Medians over ``--reps`` after three warm-ups.

    python3 bench/encode_cost.py [--rows 1 2 4 8 16] [--n 100] [--json]
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

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from turbospark.layers.cuda.kernel import Kernel

Build = Callable[[], list[mx.array]]


def timed(build: Build, n: int, reps: int) -> dict[str, float]:
    """µs an op: in ``mx.async_eval`` (``encode_us``) and to the results (``wall_us``)."""
    for _ in range(3):
        mx.eval(build())
    encode, wall = [], []
    for _ in range(reps):
        mx.synchronize()
        start = time.perf_counter()
        ops = build()
        built = time.perf_counter()
        mx.async_eval(ops)
        handed = time.perf_counter()
        mx.eval(ops)
        wall.append((time.perf_counter() - start) / n * 1e6)
        encode.append((handed - built) / n * 1e6)
    return {"encode_us": statistics.median(encode), "wall_us": statistics.median(wall)}


def _copy_kernel() -> Kernel:
    return Kernel(
        name="turbospark_bench_copy",
        input_names=["a"],
        output_names=["o"],
        source="const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "if (i < a_shape[0]) o[i] = a[i];",
    )


def encode_cost(
    rows: tuple[int, ...], width: int, outputs: int, n: int, reps: int, dtype: mx.Dtype
) -> dict[str, Any]:
    """Each op's :func:`timed` figures, by name and rows."""
    weights = [mx.random.normal((outputs, width)).astype(dtype) for _ in range(4)]
    mx.eval(weights)
    out: dict[str, Any] = {"rows": {}}
    for r in rows:
        x = mx.random.normal((r, width)).astype(dtype)
        residual = mx.random.normal((r, outputs)).astype(dtype)
        mx.eval(x, residual)
        out["rows"][r] = {
            "matmul": timed(lambda x=x: [x @ weights[i % 4].T for i in range(n)], n, reps),
            "addmm": timed(
                lambda x=x, c=residual: [mx.addmm(c, x, weights[i % 4].T) for i in range(n)],
                n,
                reps,
            ),
        }
    a = mx.random.normal((outputs,)).astype(dtype)
    mx.eval(a)
    out["elementwise"] = timed(lambda: [a * float(i + 1) for i in range(n)], n, reps)
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        kernel = _copy_kernel()

        def custom() -> list[mx.array]:
            return [
                kernel(
                    inputs=[a],
                    grid=(a.size, 1, 1),
                    threadgroup=(256, 1, 1),
                    output_shapes=[a.shape],
                    output_dtypes=[a.dtype],
                )[0]
                for _ in range(n)
            ]

        out["custom"] = timed(custom, n, reps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--width", type=int, default=2048, help="the product's inner size")
    parser.add_argument("--outputs", type=int, default=8192, help="the product's outputs")
    parser.add_argument("--n", type=int, default=100, help="ops a round")
    parser.add_argument("--reps", type=int, default=12, help="rounds; medians reported")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from bench.common import machine

    result = encode_cost(
        tuple(args.rows), args.width, args.outputs, args.n, args.reps, getattr(mx, args.dtype)
    )
    if args.json:
        json.dump({"machine": machine(), **result}, sys.stdout, indent=1)
        return 0
    for r, ops in result["rows"].items():
        for name, t in ops.items():
            print(
                f"{name:>11} rows={r:<3} encode {t['encode_us']:7.1f} µs  wall {t['wall_us']:7.1f} µs"
            )
    for name in ("elementwise", "custom"):
        if name in result:
            t = result[name]
            print(
                f"{name:>11}          encode {t['encode_us']:7.1f} µs  wall {t['wall_us']:7.1f} µs"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
