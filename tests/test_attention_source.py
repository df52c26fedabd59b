"""The decode attention kernels' source, a lone row's and a batch's, run as C++ on the CPU.

The kernels run only on MLX's CUDA backend (``tests/test_attention_cuda.py``,
on a GPU), and ``tests/test_cuda_sources.py`` only compiles them; here both
kernels' bodies, exactly as :mod:`turbospark.layers.cuda.attention` hands
them to NVRTC, run unchanged as C++ (``tests/cuda_on_cpu.py``), the partial
kernel's output feeding the merge kernel as on a GPU. Each output is held to
attention in float64 over the rows the query sees, and each row of a batch
(the per-row kernel, ``left``) equals, bit for bit, that row run alone over
its own rows by the lone row's kernel. Padding rows hold NaN, so a padding
key that reached a sum would show. Shapes: a buffer not a multiple of a
chunk, rows starting past 0 (a window), a row of one key, a head dimension
not a multiple of a warp and keys wider than values, fewer warps a block
where their outputs would overflow shared memory, and chunks grown past
``CHUNK`` where the buffer holds more than ``MAX_SPLITS`` of them (the
template's value made small here). Skipped where no C++ compiler is found.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import pytest

from cuda_on_cpu import C_TYPES, CXX, SHIMS, bf16_bits, build, floats, pointer
from turbospark.layers.cuda import attention as attention_cuda
from turbospark.layers.cuda import reduce as reduce_cuda

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++ or clang++)")


class Case(NamedTuple):
    batch: int
    kv_heads: int
    group: int
    dim: int
    value_dim: int
    capacity: int  # the buffers' rows
    start: int  # rows[0]
    stop: int  # rows[1]
    left: tuple[int, ...] | None  # each row's first row past its padding (a batch's)
    dtype: str
    max_splits: int = attention_cuda.MAX_SPLITS

    @property
    def scale(self) -> float:
        return self.dim**-0.5

    def first(self, b: int) -> int:
        return self.start if self.left is None else max(self.start, self.left[b])


CASES = [
    # a lone row: a buffer ending mid-chunk, and a window's start
    Case(1, 2, 4, 64, 64, 200, 0, 150, None, "float32"),
    Case(1, 1, 2, 32, 32, 130, 40, 129, None, "bfloat16"),
    # a batch: a row of one key, one from the window's start, one padded past it
    Case(3, 2, 4, 64, 64, 96, 8, 90, (0, 37, 89), "float32"),
    Case(2, 1, 8, 48, 32, 70, 0, 70, (5, 0), "bfloat16"),
    # five query heads of 512 columns: two warps a block (shared memory)
    Case(2, 1, 5, 512, 512, 40, 0, 33, (0, 31), "float32"),
    # chunks of 64 where the buffer holds more than MAX_SPLITS of CHUNK
    Case(2, 1, 2, 32, 32, 300, 10, 290, (0, 100), "float32", max_splits=4),
]


def _ids(case: Case) -> str:
    kind = "lone" if case.left is None else f"batch{case.batch}"
    return f"{kind}-g{case.group}-d{case.dim}x{case.value_dim}-n{case.capacity}-{case.dtype}-s{case.max_splits}"  # fmt: skip


def _launch_shape(case: Case, batch: int) -> tuple[int, int, int, int, int]:
    """Warps a block, chunks a head, partial blocks, merge threads and groups, as :func:`decode` launches them."""
    n_warps = attention_cuda.warps(case.group, case.value_dim)
    least = -(-case.capacity // case.max_splits)
    chunk = max(attention_cuda.CHUNK, -(-least // attention_cuda.CHUNK) * attention_cuda.CHUNK)
    splits = -(-case.capacity // chunk)
    column_threads = -(-case.value_dim // 32) * 32
    groups = max(1, attention_cuda.MERGE_THREADS // column_threads)
    return n_warps, splits, batch * case.kv_heads * splits, groups * column_threads, groups


def _translation_unit() -> str:
    """The shims, the kernels' header, each case's partial kernel (per-row
    where it is a batch's, and the lone row's for every case) and merge
    kernel as functions over globals, and one entry a case and form."""
    parts = [
        SHIMS,
        reduce_cuda.HEADER,
        "template <typename T> struct Args { static const T *queries, *keys, *values; static T* out; };\n"
        "template <typename T> const T* Args<T>::queries;\n"
        "template <typename T> const T* Args<T>::keys;\n"
        "template <typename T> const T* Args<T>::values;\n"
        "template <typename T> T* Args<T>::out;\n"
        "static const int32_t *rows, *left;\n"
        "static float *partial_out, *partial_stats;\n"
        "static int keys_shape[4], partial_out_shape[4];\n"
        "static long long queries_strides[4], keys_strides[4], values_strides[4];\n",
    ]
    lone, per_row = (attention_cuda._partial_kernel(1.0, p).body for p in (False, True))
    for i, case in enumerate(CASES):
        t = C_TYPES[case.dtype]
        n_warps, _, _, _, groups = _launch_shape(case, case.batch)
        consts = (
            f"    using T = {t};\n    constexpr int D = {case.dim}, DV = {case.value_dim}, G = {case.group},"
            f" NW = {n_warps}, CHUNK = {attention_cuda.CHUNK}, MAX_SPLITS = {case.max_splits};\n"
            "    const T* queries = Args<T>::queries; const T* keys = Args<T>::keys;"
            " const T* values = Args<T>::values;\n"
        )
        scaled = f"constexpr float SCALE = {float(case.scale)!r}f;"
        for form, body in (("lone", lone), ("per_row", per_row)):
            parts.append(
                f"void partial_{form}_{i}() {{\n{consts}"
                + body.replace("constexpr float SCALE = 1.0f;", scaled)
                + "\n}\n"
            )
        merge = attention_cuda._merge_kernel().body
        column_threads = -(-case.value_dim // 32) * 32
        parts.append(
            f"void merge_{i}() {{\n    using T = {t};\n"
            f"    constexpr int DV = {case.value_dim}, DVP = {column_threads}, GROUPS = {groups};\n"
            "    T* out = Args<T>::out;\n" + merge + "\n}\n"
        )
        # One entry a case: the batch's (or lone) inputs, its form, and the batch size.
        parts.append(
            f'extern "C" int run_{i}(const void* q, const void* k, const void* v, const int32_t* r,\n'
            f"        const int32_t* l, float* po, float* ps, void* o, int batch, int per_row) {{\n"
            f"    Args<{t}>::queries = static_cast<const {t}*>(q);"
            f" Args<{t}>::keys = static_cast<const {t}*>(k);\n"
            f"    Args<{t}>::values = static_cast<const {t}*>(v); Args<{t}>::out = static_cast<{t}*>(o);\n"
            f"    rows = r; left = l; partial_out = po; partial_stats = ps;\n"
            f"    const int n = {case.capacity}, heads = {case.kv_heads * case.group};\n"
            f"    keys_shape[0] = batch; keys_shape[1] = {case.kv_heads}; keys_shape[2] = n;"
            f" keys_shape[3] = {case.dim};\n"
            f"    const long long qs[4] = {{heads * {case.dim}, {case.dim}, {case.dim}, 1}};\n"
            f"    const long long ks[4] = {{{case.kv_heads} * n * {case.dim}, n * {case.dim}, {case.dim}, 1}};\n"
            f"    const long long vs[4] = {{{case.kv_heads} * n * {case.value_dim},"
            f" n * {case.value_dim}, {case.value_dim}, 1}};\n"
            f"    for (int i = 0; i < 4; ++i) {{ queries_strides[i] = qs[i]; keys_strides[i] = ks[i];"
            f" values_strides[i] = vs[i]; }}\n"
            f"    const int splits = {_launch_shape(case, 1)[1]};\n"
            f"    partial_out_shape[0] = batch; partial_out_shape[1] = heads;"
            f" partial_out_shape[2] = splits; partial_out_shape[3] = {case.value_dim};\n"
            f"    if (!launch(per_row ? partial_per_row_{i} : partial_lone_{i},"
            f" batch * {case.kv_heads} * splits, {n_warps * 32})) return 0;\n"
            f"    return launch(merge_{i}, batch * heads, {_launch_shape(case, 1)[3]});\n}}\n"
        )
    return "\n".join(parts)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build(_translation_unit(), tmp_path_factory.mktemp("attention_source"), "attention")


def _inputs(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Queries and the buffers (bfloat16 bits where the case is bfloat16),
    NaN in every row a query must not see: before its first row and from the
    stop on."""
    rng = np.random.default_rng(case.capacity * case.group + case.dim)
    heads = case.kv_heads * case.group
    queries = rng.normal(size=(case.batch, heads, 1, case.dim)).astype(np.float32)
    keys = rng.normal(size=(case.batch, case.kv_heads, case.capacity, case.dim)).astype(np.float32)
    values = rng.normal(size=(case.batch, case.kv_heads, case.capacity, case.value_dim))
    values = values.astype(np.float32)
    for b in range(case.batch):
        for buffer in (keys, values):
            buffer[b, :, : case.first(b)] = np.nan
            buffer[b, :, case.stop :] = np.nan
    if case.dtype == "bfloat16":
        return bf16_bits(queries), bf16_bits(keys), bf16_bits(values)
    return queries, keys, values


def _run(
    library: ctypes.CDLL,
    case: Case,
    inputs: tuple[np.ndarray, ...],
    rows: tuple[int, int],
    left: tuple[int, ...] | None,
) -> np.ndarray:
    """``(B, heads, 1, Dv)``: the partial kernel (per-row where *left* is
    given) then the merge, over *inputs*' batch."""
    queries, keys, values = (np.ascontiguousarray(a) for a in inputs)
    batch, heads = queries.shape[:2]
    splits = _launch_shape(case, batch)[1]
    bounds = np.array(rows, dtype=np.int32)
    firsts = np.array(left if left is not None else [0] * batch, dtype=np.int32)
    partial_out = np.full((batch, heads, splits, case.value_dim), np.nan, dtype=np.float32)
    partial_stats = np.full((batch, heads, splits, 2), np.nan, dtype=np.float32)
    out = np.full((batch, heads, 1, case.value_dim), 0xFFFF, dtype=queries.dtype)
    if out.dtype == np.float32:
        out[:] = np.nan
    ok = getattr(library, f"run_{CASES.index(case)}")(
        pointer(queries), pointer(keys), pointer(values), pointer(bounds), pointer(firsts),
        pointer(partial_out), pointer(partial_stats), pointer(out), batch, int(left is not None),
    )  # fmt: skip
    assert ok, "a thread ended while others waited at a barrier or shuffle"
    return out


def _float64(case: Case, inputs: tuple[np.ndarray, ...]) -> np.ndarray:
    """Attention in float64 over each row's visible rows."""
    queries, keys, values = (floats(a) for a in inputs)
    out = np.zeros((case.batch, case.kv_heads * case.group, 1, case.value_dim))
    for b in range(case.batch):
        seen = slice(case.first(b), case.stop)
        for h in range(case.kv_heads * case.group):
            kv = h // case.group
            scores = keys[b, kv, seen] @ queries[b, h, 0] * case.scale
            weights = np.exp(scores - scores.max())
            out[b, h, 0] = weights @ values[b, kv, seen] / weights.sum()
    return out


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_equals_float64_attention_over_the_rows_it_sees(library: ctypes.CDLL, case: Case) -> None:
    inputs = _inputs(case)
    got = floats(_run(library, case, inputs, (case.start, case.stop), case.left))
    exact = _float64(case, inputs)
    assert not np.isnan(got).any(), "a row the query must not see reached its output"
    bound = 1e-5 + (2.0**-8 if case.dtype == "bfloat16" else 0.0) * np.abs(exact)
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) - bound)


@pytest.mark.parametrize("case", [c for c in CASES if c.left is not None], ids=_ids)
def test_each_batch_row_equals_that_row_alone(library: ctypes.CDLL, case: Case) -> None:
    """The per-row kernel's row ``b`` is the lone row's kernel over rows
    ``[max(start, left[b]), stop)`` of that row's buffers, bit for bit."""
    inputs = _inputs(case)
    batch = _run(library, case, inputs, (case.start, case.stop), case.left)
    for b in range(case.batch):
        alone = _run(library, case, tuple(a[b : b + 1] for a in inputs), (case.first(b), case.stop), None)  # fmt: skip
        assert np.array_equal(batch[b : b + 1], alone), f"row {b} differs from its run alone"
