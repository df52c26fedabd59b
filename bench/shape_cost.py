"""What a shape costs the first time it runs, op by op and forward by forward.

A server's prefill groups rarely repeat a shape (rows, new tokens, held
tokens), and on the H200 a batched prefill forward of ``chat_large`` costs
20–80 ms the first time its shape runs against 6–10 ms at once again
(bench/README.md, "The per-shape prefill cost"). Each measurement below runs a
case, synchronised, the first time and again, in one process:

1. **ops**: one attention call per case (rows, heads, kv heads, head dim,
   queries, keys; ``"causal"`` for one row, a padding mask for several):
   ``op`` is ``mx.fast.scaled_dot_product_attention`` (cuDNN builds a graph
   per shape for heads up to 128 wide), ``matmul`` is
   :func:`turbospark.layers.attention.matmul_attention`, which the families
   take for several queries on CUDA since the eighth session.
2. **gemms**: ``x @ w`` and ``addmm`` in bf16 at the ``chat_large`` weights'
   widths, for rows ``M`` in a rising sequence: whether a GEMM pays once per
   new problem, and which neighbours share the payment.
3. **forwards**: :func:`bench.prefill_cost.shapes` (a batched prefill forward
   per case) with what the process may change first, each a hypothesis about
   where the first-time cost lives:
   - ``form="op"``: several queries routed back to the op (cuDNN);
   - ``warm_gemms=M``: every distinct 2-D weight multiplied at rows 1..M
     (``matmul`` and both ``addmm`` forms) before the first case, so the
     weights' GEMM problems have all run once; ``warm_cases`` only at the
     cases' own ``(rows, new tokens)`` shapes (rows 1..1,536 overflow
     cuBLASLt's heuristics cache);
   - ``pad_attention=(q, k)``: queries and keys padded up to multiples of
     *q* and *k* (masked), so attention's problems repeat within a bucket;
   - ``cache_limit``: ``mx.set_cache_limit`` (MLX's cache of freed buffers);
   - ``keep_pool``: the CUDA driver's default memory pool keeps what is
     freed (release threshold raised to the maximum, through ``ctypes``:
     MLX sets none, so the pool is trimmed at every synchronisation);
     ``reserve_gb`` also grows it by that much at once (one allocation from
     it, freed), so later allocations are carved from memory it holds.

   Every case reads the pool's reserved and used memory and MLX's active and
   cached memory before and after its first run (:func:`memory`).
4. **residual**: not a first-time cost but a steady one: ``residual + x @ w``
   for a batched decode step's ``(B, 1, K)`` rows, as ``addmm`` over the
   batched residual, as :func:`turbospark.layers.stacked.gemm_add`
   (rows folded) and as a matmul and an add (:func:`residual_forms`).
5. **modules**: one case's forward, first time and again, with every module
   class of the model timed inclusively (its output evaluated and
   synchronised on return), so the first-time cost can be placed in a layer
   part (attention, MLP, norm, embedding) rather than in the whole forward.
   Evaluating each module's output splits the forward's graph where it
   would otherwise run as one, so these times are for locating, not totals.

   Settings that must be made before CUDA starts (``CUDA_MODULE_LOADING``,
   ``MLX_USE_CUDA_GRAPHS``) are the caller's environment, recorded in the
   output line.

MLX keeps its JIT-compiled kernels on disk, so the first process on a fresh
machine also pays those; compare processes after the first.

Run: ``uv run python bench/shape_cost.py ops | gemms | residual | forwards | modules --family
gemma4 --size chat_large --dtype bfloat16 [--warm-gemms 1536] [--pad-attention
64 256] [--cases 3,145,80 3,150,90]``; the H200's lines are in
``bench/results/gpu/h200_s8_attention_probe.jsonl`` and
``h200_s9_shape_cost.jsonl``.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import lru_cache
from pathlib import Path
from types import FunctionType
from typing import Any

os.environ.setdefault("MLX_ENABLE_TF32", "0")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
from mlx.utils import tree_flatten

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
# (N, K) of chat_large's projections, and rows rising, with near neighbours
GEMM_WIDTHS = [(2048, 2048), (16384, 2048), (2048, 8192), (512, 2048)]
GEMM_ROWS = [145, 146, 290, 291, 435, 436, 437, 512, 777, 1024, 1500]
# (N, K) of chat_large's residual projections: o_proj / out_proj, and down_proj
RESIDUAL_WIDTHS = [(2048, 2048), (2048, 8192)]
# CUmemPool_attribute's CU_MEMPOOL_ATTR_{RELEASE_THRESHOLD, RESERVED_MEM_CURRENT,
# USED_MEM_CURRENT} (cuda.h)
_RELEASE_THRESHOLD, _RESERVED, _USED = 4, 5, 7


_FORMS: dict[str, Callable[..., mx.array]] = {
    "op": lambda q, k, v, mask: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask),
    "matmul": lambda q, k, v, mask: attention.matmul_attention(q, k, v, 0.1, mask),
}


def _timed(fn: Callable[[], Any]) -> float:
    mx.synchronize()
    began = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return round(1e3 * (time.perf_counter() - began), 3)


def ops(
    cases: list[tuple[int, ...]] = CASES, dtype: mx.Dtype = mx.bfloat16, times: int = 3
) -> list[dict[str, Any]]:
    """Milliseconds of each attention form on each case, *times* calls in a row."""
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


def gemms(
    widths: list[tuple[int, int]] = GEMM_WIDTHS,
    rows: list[int] = GEMM_ROWS,
    dtype: mx.Dtype = mx.bfloat16,
    times: int = 3,
) -> list[dict[str, Any]]:
    """Milliseconds of ``x @ w`` and ``addmm(r, x, w)`` at each width and row
    count, *times* calls in a row (inputs built before the first)."""
    mx.eval(mx.ones((8, 64), dtype) @ mx.ones((64, 64), dtype))  # the first GEMM's setup
    out = []
    for n, k in widths:
        w = mx.random.normal((k, n)).astype(dtype)
        mx.eval(w)
        for m in rows:
            x = mx.random.normal((m, k)).astype(dtype)
            r = mx.random.normal((m, n)).astype(dtype)
            mx.eval(x, r)
            forms = {"matmul": lambda x=x, w=w: x @ w, "addmm": lambda r=r, x=x, w=w: mx.addmm(r, x, w)}  # fmt: skip
            for op, fn in forms.items():
                timings = [_timed(fn) for _ in range(times)]
                out.append({"op": op, "M": m, "N": n, "K": k, "ms": timings})
    return out


def residual_forms(
    widths: list[tuple[int, int]] = RESIDUAL_WIDTHS,
    rows: tuple[int, ...] = (1, 4, 16),
    dtype: mx.Dtype = mx.bfloat16,
    calls: int = 30,
) -> list[dict[str, Any]]:
    """Steady-state milliseconds of ``residual + x @ w`` for ``x`` of shape
    ``(B, 1, K)`` (a batched decode step's projection), three ways: ``addmm``
    with the batched residual as is, :func:`turbospark.layers.stacked.gemm_add`
    (the rows folded into one GEMM on the CPU; on a GPU the ``addmm`` as is,
    or a matmul and an add at one row) and a matmul then an add; median of
    *calls* synchronised calls after five unmeasured ones."""
    from turbospark.layers.stacked import gemm_add

    out = []
    for n, k in widths:
        w = mx.random.normal((k, n)).astype(dtype)
        for b in rows:
            x = mx.random.normal((b, 1, k)).astype(dtype)
            r = mx.random.normal((b, 1, n)).astype(dtype)
            mx.eval(w, x, r)
            forms = {
                "addmm": lambda r=r, x=x, w=w: mx.addmm(r, x, w),
                "gemm_add": lambda r=r, x=x, w=w: gemm_add(r, x, w),
                "matmul_add": lambda r=r, x=x, w=w: x @ w + r,
            }
            for form, fn in forms.items():
                for _ in range(5):
                    _timed(fn)
                ms = sorted(_timed(fn) for _ in range(calls))[calls // 2]
                out.append({"form": form, "B": b, "N": n, "K": k, "ms": ms})
    return out


def warm_gemms(
    model: Any, max_rows: int, at: list[tuple[int, ...]] | None = None
) -> dict[str, Any]:
    """Multiply every distinct 2-D weight of *model* (as ``x @ w.T``, with and
    without a bias row or a full residual for ``addmm``) at rows 1..*max_rows*,
    or only at the leading shapes *at* (``x`` of shape ``(*lead, k)``: a
    forward's own ``(rows, new tokens)``). Rows 1..1,536 are more problems
    than cuBLASLt's heuristics cache holds (8,192 by default), so the early
    ones may be gone again before a forward runs; *at* warms only what it needs."""
    began = time.perf_counter()
    weights = {(w.shape, w.dtype): w for _, w in tree_flatten(model.parameters()) if w.ndim == 2}
    leads = at if at is not None else [(m,) for m in range(1, max_rows + 1)]
    for (shape, dtype), w in weights.items():
        n, k = shape
        bias = mx.zeros((n,), dtype)
        for lead in leads:
            x = mx.zeros((*lead, k), dtype)
            mx.eval(x @ w.T, mx.addmm(bias, x, w.T), mx.addmm(mx.zeros((*lead, n), dtype), x, w.T))
    mx.synchronize()
    return {"weights": [list(s) for s, _ in weights], "seconds": round(time.perf_counter() - began, 2)}  # fmt: skip


@contextmanager
def padded_attention(queries: int, keys: int) -> Iterator[None]:
    """``matmul_attention`` with several queries padded to multiples of
    *queries* and keys to multiples of *keys* (the padding masked; a padded
    query row sees key 0 and its output is dropped), the same outputs."""
    real = attention.matmul_attention

    def padded(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str) -> mx.array:  # fmt: skip
        length, held = q.shape[2], k.shape[2]
        if length == 1:
            return real(q, k, v, scale, mask)
        if isinstance(mask, str):
            mask = attention.causal_visible(length, held)
        rows, cols = -(-length // queries) * queries, -(-held // keys) * keys
        q = mx.pad(q, [(0, 0), (0, 0), (0, rows - length), (0, 0)])
        k = mx.pad(k, [(0, 0), (0, 0), (0, cols - held), (0, 0)])
        v = mx.pad(v, [(0, 0), (0, 0), (0, cols - held), (0, 0)])
        widths = [(0, 0)] * (mask.ndim - 2) + [(0, rows - length), (0, cols - held)]
        mask = mx.pad(mask, widths, constant_values=False)
        mask = mask | ((mx.arange(rows) >= length)[:, None] & (mx.arange(cols) == 0)[None])
        return real(q, k, v, scale, mask)[:, :, :length]

    attention.matmul_attention = padded
    try:
        yield
    finally:
        attention.matmul_attention = real


@contextmanager
def op_attention() -> Iterator[None]:
    """Several queries routed back to ``mx.fast.scaled_dot_product_attention``."""
    real = attention.matmul_attention
    attention.matmul_attention = lambda q, k, v, scale, mask: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask
    )
    try:
        yield
    finally:
        attention.matmul_attention = real


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"the CUDA driver refused {what} (CUresult {status})")


@lru_cache
def _default_pool() -> tuple[ctypes.CDLL, ctypes.c_int, ctypes.c_void_p]:
    """The driver library, device 0 and its default memory pool (the one MLX's
    ``cudaMallocAsync`` draws from), after MLX has made its context; looked up
    once, not at every :func:`memory` reading."""
    cuda = ctypes.CDLL("libcuda.so.1")
    mx.eval(mx.zeros((1,)))
    device, pool = ctypes.c_int(), ctypes.c_void_p()
    _check(cuda.cuInit(0), "cuInit")
    _check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    _check(cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), device), "the default pool")
    return cuda, device, pool


def keep_pool(reserve_bytes: int = 0) -> int:
    """Raise the release threshold of device 0's default CUDA memory pool to
    the maximum (the pool then keeps freed memory) and, with *reserve_bytes*,
    grow the pool by that much at once (one allocation from it, freed): later
    allocations of any size are carved from memory the pool already holds,
    where otherwise each one MLX's cache cannot serve grows the pool. Returns
    the threshold."""
    cuda, device, pool = _default_pool()
    threshold = ctypes.c_uint64(2**64 - 1)
    _check(cuda.cuMemPoolSetAttribute(pool, _RELEASE_THRESHOLD, ctypes.byref(threshold)), "the threshold")  # fmt: skip
    if reserve_bytes:
        context, pointer = ctypes.c_void_p(), ctypes.c_uint64()
        cuda.cuMemFreeAsync.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
        _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "the primary context")
        _check(cuda.cuCtxPushCurrent_v2(context), "the context push")
        _check(cuda.cuMemAllocFromPoolAsync(ctypes.byref(pointer), ctypes.c_size_t(reserve_bytes), pool, None), "the reservation")  # fmt: skip
        _check(cuda.cuMemFreeAsync(pointer.value, None), "the free")
        _check(cuda.cuStreamSynchronize(None), "the synchronisation")
        _check(cuda.cuCtxPopCurrent_v2(ctypes.byref(context)), "the context pop")
    return threshold.value


def memory() -> dict[str, float]:
    """MB: the default pool's reserved and used memory (CUDA), MLX's active
    and cached buffers."""
    out = {"mlx_active_mb": mx.get_active_memory() / 2**20, "mlx_cache_mb": mx.get_cache_memory() / 2**20}  # fmt: skip
    if mx.cuda.is_available():
        cuda, _, pool = _default_pool()
        for name, attribute in (("pool_reserved_mb", _RESERVED), ("pool_used_mb", _USED)):
            value = ctypes.c_uint64()
            _check(cuda.cuMemPoolGetAttribute(pool, attribute, ctypes.byref(value)), name)
            out[name] = value.value / 2**20
    return {k: round(v, 1) for k, v in out.items()}


def forwards(
    path: Path,
    form: str = "matmul",
    cases: list[tuple[int, int, int]] | None = None,
    warm_rows: int = 0,
    pad: tuple[int, int] | None = None,
    cache_limit: int | None = None,
    pool: bool = False,
    reserve_gb: float = 0.0,
    warm_cases: bool = False,
) -> dict[str, Any]:
    """:func:`bench.prefill_cost.shapes` under the settings in the module's
    docstring; returns the rows and what each setting did."""
    import bench.prefill_cost as prefill_cost

    settings: dict[str, Any] = {"form": form, "pad_attention": pad, "cache_limit": cache_limit}
    if pool or reserve_gb:
        settings["pool_release_threshold"] = keep_pool(int(reserve_gb * 2**30))
        settings["reserve_gb"] = reserve_gb
    if cache_limit is not None:
        mx.set_cache_limit(cache_limit)

    cases = cases or prefill_cost.CASES

    def warm(runner: Any) -> None:
        at = sorted({(r, n) for r, n, _ in cases} | {(r, 1) for r, _, _ in cases}) if warm_cases else None  # fmt: skip
        settings["warm_gemms"] = warm_gemms(runner.model, warm_rows, at)

    with ExitStack() as stack:
        if form == "op":
            stack.enter_context(op_attention())
        if pad is not None:
            stack.enter_context(padded_attention(*pad))
        rows = prefill_cost.shapes(path, cases, on_open=warm if warm_rows or warm_cases else None, probe=memory)  # fmt: skip
    settings["peak_gb"] = round(mx.get_peak_memory() / 1e9, 2)
    return {"settings": settings, "rows": rows}


@contextmanager
def timed_modules(model: Any, spent: dict[str, float]) -> Iterator[None]:
    """Every module class in *model* evaluates and synchronises its output on
    return, its inclusive wall time added to ``spent[class name]``."""
    originals = {
        cls: call
        for cls in {type(m) for m in model.modules()}
        # a container module (no __call__ of its own) is left alone
        if isinstance(call := inspect.getattr_static(cls, "__call__", None), FunctionType)
    }

    def wrap(cls: type, real: Callable[..., Any]) -> Callable[..., Any]:
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            mx.synchronize()
            began = time.perf_counter()
            out = real(self, *args, **kwargs)
            mx.eval([a for _, a in tree_flatten(out) if isinstance(a, mx.array)])
            mx.synchronize()
            spent[cls.__name__] = spent.get(cls.__name__, 0.0) + time.perf_counter() - began
            return out

        return timed

    own = {cls for cls in originals if "__call__" in vars(cls)}
    for cls, real in originals.items():
        cls.__call__ = wrap(cls, real)
    try:
        yield
    finally:
        for cls, real in originals.items():
            if cls in own:
                cls.__call__ = real
            else:
                del cls.__call__


def modules(path: Path, cases: list[tuple[int, int, int]], seed: int = 0) -> list[dict[str, Any]]:
    """Per case (rows, new tokens, held tokens): each module class's inclusive
    milliseconds in the forward the first time its shape runs, then again."""
    import numpy as np

    from bench.prefill_cost import timed_forward
    from turbospark.generation.runner import Runner

    runner = Runner.open(path, context_length=4096, session_slots=16)
    rng = np.random.default_rng(seed)

    def forward(rows: int, length: int, held: int) -> dict[str, float]:
        spent: dict[str, float] = {}
        timed_forward(runner, rng, rows, length, held, lambda: timed_modules(runner.model, spent))
        return spent

    forward(1, 8, 0)  # the process's own first forward (its compiles)
    out = []
    for case in cases:
        first, again = forward(*case), forward(*case)
        ms = {name: [round(1e3 * t, 2), round(1e3 * again.get(name, 0.0), 2)] for name, t in first.items()}  # fmt: skip
        out.append({"case": list(case), "ms": ms})
    runner.close()
    return out


def main() -> None:
    from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["ops", "gemms", "forwards", "modules", "residual"])
    parser.add_argument("--family", choices=FAMILIES, default="gemma4")
    parser.add_argument("--form", choices=["op", "matmul"], default="matmul")
    parser.add_argument("--size", default="chat_host")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--cases", nargs="+", default=None, help="rows,new,held ...")
    parser.add_argument("--warm-gemms", type=int, default=0, metavar="ROWS")
    parser.add_argument("--pad-attention", type=int, nargs=2, default=None, metavar=("Q", "K"))
    parser.add_argument("--cache-limit", type=int, default=None, metavar="BYTES")
    parser.add_argument("--keep-pool", action="store_true")
    parser.add_argument("--warm-cases", action="store_true", help="warm the weights' GEMMs at the cases' own shapes")  # fmt: skip
    parser.add_argument("--reserve-pool", type=float, default=0.0, metavar="GB", help="also grow the kept pool by GB first")  # fmt: skip
    args = parser.parse_args()
    began = time.perf_counter()
    if args.what == "ops":
        result: Any = ops()
    elif args.what == "gemms":
        result = gemms()
    elif args.what == "residual":
        result = residual_forms(dtype=mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32)
    elif args.what == "modules":
        path = install(args.family, args.size, args.dtype or default_dtype(), args.cache_dir)
        cases = [
            tuple(int(v) for v in c.split(",")) for c in args.cases or ["3,145,80", "3,150,90"]
        ]
        result = {"family": args.family, "rows": modules(path, cases)}  # type: ignore[arg-type]
    else:
        path = install(args.family, args.size, args.dtype or default_dtype(), args.cache_dir)
        cases = [tuple(int(v) for v in c.split(",")) for c in args.cases] if args.cases else None
        result = {
            "family": args.family,
            **forwards(
                path,
                args.form,
                cases,  # type: ignore[arg-type]
                args.warm_gemms,
                tuple(args.pad_attention) if args.pad_attention else None,
                args.cache_limit,
                args.keep_pool,
                args.reserve_pool,
                args.warm_cases,
            ),
        }
    environment = {k: os.environ.get(k) for k in ("CUDA_MODULE_LOADING", "MLX_USE_CUDA_GRAPHS")}
    wall = round(time.perf_counter() - began, 1)
    print(json.dumps({"probe": args.what, "environment": environment, "wall_s": wall, "result": result}))  # fmt: skip


if __name__ == "__main__":
    main()
