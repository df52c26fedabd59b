"""The few-row float product's kernel source run as C++ on the CPU against float64.

The kernel (:mod:`turbospark.layers.cuda.fmv`) runs only on MLX's CUDA
backend (``tests/test_fmv_cuda.py``, on a GPU), and
``tests/test_cuda_sources.py`` only compiles it. Here its body and load
header run unchanged as C++ (``tests/cuda_on_cpu.py``), with each
``mma.sync`` computed from the lanes' fragments as PTX lays them out (the
one part replaced: the inline PTX itself), so the permutation of k that
the kernel's loads rely on is checked: a lane's 16 bytes of x and of a
weight row must meet as the same terms of the same dot product. Each
product is held to float64, with no addend, a bias and a residual; outputs
past the last row or column stay unwritten. Shapes: 1 to 16 rows, outputs
not a multiple of a block's 16, widths of one to several 32-value blocks
a warp, a block's warps splitting the width unevenly, 1, 2 and 4 tiles of
outputs a warp, and x starting one element past a 16-byte boundary (the value-by-value loads). bfloat16, as a
GPU's decode runs it. Skipped where no C++ compiler is found.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import pytest

from cuda_on_cpu import CXX, SHIMS, bf16_bits, build, floats, pointer
from turbospark.layers.cuda import fmv as fmv_cuda

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++ or clang++)")

# The MMA on the CPU: the harness's warp collective, for the kernel's one call.
CPU_MMA = """
inline void mma(const bf16*, float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    warp_mma(c, a, b0, b1, false);
}
"""


class Case(NamedTuple):
    rows: int
    width: int
    outputs: int
    add: int  # 0 none, 1 a bias, 2 a residual
    offset: int  # elements x starts past a 16-byte boundary
    tiles: int = fmv_cuda.TILES

    @property
    def split(self) -> int:
        return fmv_cuda.split_for(self.outputs, self.width, self.tiles)


CASES = [
    Case(2, 64, 40, 0, 0),
    Case(16, 256, 24, 0, 0),
    Case(9, 96, 16, 1, 0),
    Case(5, 128, 33, 2, 1),
    Case(1, 32, 8, 2, 0),
    Case(12, 2048, 20, 1, 0),
    Case(7, 192, 50, 2, 0, tiles=1),
    Case(16, 512, 70, 0, 1, tiles=4),
]


def _ids(case: Case) -> str:
    return f"r{case.rows}-k{case.width}-n{case.outputs}-add{case.add}-s{case.split}-t{case.tiles}-o{case.offset}"


def _translation_unit() -> str:
    parts = [
        SHIMS,
        CPU_MMA,
        fmv_cuda._LOAD_HEADER,
        "static const bf16 *x, *w, *addend;\nstatic bf16* y;\nstatic int x_shape[2], w_shape[2];\n",
    ]
    for i, case in enumerate(CASES):
        body = fmv_cuda._kernel(case.add).body
        parts.append(
            f"void kernel_{i}() {{\n    using T = bf16;\n"
            f"    constexpr int K = {case.width}, TILES = {case.tiles}, SPLIT = {case.split};\n"
            f"{body}\n}}\n"
            f'extern "C" int run_{i}(const void* x_, const void* w_, const void* add_, void* y_) {{\n'
            f"    x = static_cast<const bf16*>(x_); w = static_cast<const bf16*>(w_);\n"
            f"    addend = static_cast<const bf16*>(add_); y = static_cast<bf16*>(y_);\n"
            f"    x_shape[0] = {case.rows}; x_shape[1] = {case.width};\n"
            f"    w_shape[0] = {case.outputs}; w_shape[1] = {case.width};\n"
            f"    const int blocks = {-(-case.outputs // (8 * case.tiles))};\n"
            f"    return launch(kernel_{i}, blocks, {case.split * 32});\n}}\n"
        )
    return "\n".join(parts)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build(_translation_unit(), tmp_path_factory.mktemp("fmv_source"), "fmv")


def _inputs(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (inside a buffer, at the case's offset), the weight and the addend, as bfloat16 bits."""
    rng = np.random.default_rng(case.rows * 1000 + case.width + case.outputs)
    x = rng.normal(size=case.rows * case.width + 8).astype(np.float32)
    w = rng.normal(size=(case.outputs, case.width)).astype(np.float32) * 0.1
    shape = [(1,), (case.outputs,), (case.rows, case.outputs)][case.add]
    addend = rng.normal(size=shape).astype(np.float32)
    return bf16_bits(x), bf16_bits(w), bf16_bits(addend)


def _run(library: ctypes.CDLL, case: Case, inputs: tuple[np.ndarray, ...]) -> np.ndarray:
    """The product's rows, read from an output buffer with sentinels past its end."""
    x, w, addend = (np.ascontiguousarray(a) for a in inputs)
    size = case.rows * case.outputs
    out = np.full(size + 16, 0x7FC1, dtype=np.uint16)  # a NaN's bits
    start = ctypes.c_void_p(x.ctypes.data + case.offset * x.itemsize)
    ok = getattr(library, f"run_{CASES.index(case)}")(start, pointer(w), pointer(addend), pointer(out))  # fmt: skip
    assert ok, "a thread ended while others waited at a barrier, shuffle or MMA"
    assert np.all(out[size:] == 0x7FC1), "the kernel wrote past its output"
    return out[:size].reshape(case.rows, case.outputs)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_equals_float64(library: ctypes.CDLL, case: Case) -> None:
    inputs = _inputs(case)
    x, w, addend = (floats(a) for a in inputs)
    x = x[case.offset : case.offset + case.rows * case.width].reshape(case.rows, case.width)
    exact = x @ w.T + (addend if case.add else 0.0)
    size = np.abs(x) @ np.abs(w).T
    got = floats(_run(library, case, inputs))
    bound = 1e-6 * size + 2.0**-8 * np.abs(exact)  # float32 sums, then one bfloat16 rounding
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) - bound)
