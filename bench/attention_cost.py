"""What several queries' attention costs the first time a shape runs, by form.

On CUDA, MLX sends several queries (a prefill chunk, a batched prefill group)
to cuDNN's fused attention where the head dim is at most 128, and cuDNN builds
a graph the first time it meets each shape of queries, keys and mask. A
server's prefill shapes rarely repeat, so since the eighth session the
families' attention takes :func:`turbospark.layers.attention.matmul_attention`
there instead. Two measurements say what that buys:

1. **ops**: one attention call per case (rows, heads, kv heads, head dim,
   queries, keys; ``"causal"`` for one row, a padding mask for several),
   timed three times in a row, synchronised: ``op`` is
   ``mx.fast.scaled_dot_product_attention``, ``matmul`` is
   ``matmul_attention``. The first time is the per-shape cost.
2. **forwards**: :func:`bench.prefill_cost.shapes` (one batched prefill
   forward per chat-workload shape, first time and again) with either form in
   the families (``form="op"`` routes several queries back to the op, as
   before the change). Each form in its own process: MLX keeps its compiled
   kernels on disk, so whichever runs first in a fresh machine also pays
   those (``process_order`` in the recorded lines).

Run: ``uv run python bench/attention_cost.py ops`` or ``... forwards --family
gemma4 --form op --size chat_large --dtype bfloat16``; the H200's lines are in
``bench/results/gpu/h200_s8_attention_probe.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("MLX_ENABLE_TF32", "0")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from turbospark.layers import attention

# (rows, heads, kv heads, head dim, queries, keys): the chat workload's groups,
# a long single-row chunk, and a head dim of 64
CASES = [
    (3, 8, 2, 128, 145, 225),
    (3, 8, 2, 128, 146, 226),
    (2, 8, 2, 128, 145, 370),
    (1, 8, 2, 128, 512, 512),
    (1, 8, 2, 128, 512, 1024),
    (3, 8, 2, 64, 144, 224),
]


_FORMS: dict[str, Callable[..., mx.array]] = {
    "op": lambda q, k, v, mask: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask),
    "matmul": lambda q, k, v, mask: attention.matmul_attention(q, k, v, 0.1, mask),
}


def _timed(fn: Callable[[], mx.array]) -> float:
    mx.synchronize()
    began = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return round(1e3 * (time.perf_counter() - began), 3)


def ops(
    cases: list[tuple[int, ...]] = CASES, dtype: mx.Dtype = mx.bfloat16, times: int = 3
) -> list[dict[str, Any]]:
    """Milliseconds of each form on each case, *times* calls in a row."""
    warm = mx.ones((1, 2, 4, 64), dtype)  # the process's first attention (its own compiles)
    mx.eval(mx.fast.scaled_dot_product_attention(warm, warm, warm, scale=1.0, mask="causal"))
    rows = []
    for batch, heads, kv_heads, dim, length, keys in cases:
        q = mx.random.normal((batch, heads, length, dim)).astype(dtype)
        k = mx.random.normal((batch, kv_heads, keys, dim)).astype(dtype)
        v = mx.random.normal((batch, kv_heads, keys, dim)).astype(dtype)
        if batch == 1:
            mask: mx.array | str = "causal"
        else:  # the rows' padding, as BatchLayerKV.mask builds it
            left = mx.array([0, 3, 7, 11][:batch])[:, None, None, None]
            visible = attention.causal_visible(length, keys)[None, None]
            mask = visible & (mx.arange(keys) >= left)
        mx.eval(q, k, v, *([] if isinstance(mask, str) else [mask]))
        row: dict[str, Any] = dict(zip(("B", "H", "Hk", "D", "L", "T"), (batch, heads, kv_heads, dim, length, keys), strict=True))  # fmt: skip
        args = (q, k, v, mask)
        for name, form in _FORMS.items():
            row[name] = [_timed(lambda f=form, a=args: f(*a)) for _ in range(times)]
        rows.append(row)
    return rows


def forwards(path: Path, form: str, **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`bench.prefill_cost.shapes` with *form* (``"matmul"``: the
    families' own; ``"op"``: several queries routed back to the op)."""
    from bench.prefill_cost import shapes

    real = attention.matmul_attention
    if form == "op":
        attention.matmul_attention = lambda q, k, v, scale, mask: (
            mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        )
    try:
        return shapes(path, **kwargs)
    finally:
        attention.matmul_attention = real


def main() -> None:
    from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["ops", "forwards"])
    parser.add_argument("--family", choices=FAMILIES, default="gemma4")
    parser.add_argument("--form", choices=["op", "matmul"], default="matmul")
    parser.add_argument("--size", default="chat_host")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    if args.what == "ops":
        result: Any = ops()
    else:
        path = install(args.family, args.size, args.dtype or default_dtype(), args.cache_dir)
        result = {"family": args.family, "form": args.form, "rows": forwards(path, args.form)}
    print(json.dumps({"probe": args.what, "result": result}))


if __name__ == "__main__":
    main()
