"""Every hand-written CUDA kernel compiles for the H100 and H200 (sm_90), on a machine without a GPU.

The kernels run only on MLX's CUDA backend (``tests/test_*_cuda.py``, on the
bench machine), so without this an edit to one goes untested until a device
session, which is short and often spent. Here each kernel module's entry is
called on the CPU with the compile step (:func:`turbospark.layers.cuda.kernel.cubin`)
and MLX's launch replaced by recorders, which keep the very source NVRTC
would compile. nvcc then compiles every one of them in one translation unit
(the shared prelude once, each kernel in its own namespace), and NVRTC
compiles each where its library is found (``TURBOSPARK_NVRTC`` names it
here). This catches a source that does not compile (a typo, a missing header
function, a type error), not a launch that fails: the GPU tests decide that.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from helpers import GDN_DIMS, gdn_inputs
from turbospark.layers.cuda import attention as attention_cuda
from turbospark.layers.cuda import fmv as fmv_cuda
from turbospark.layers.cuda import gdn as gdn_cuda
from turbospark.layers.cuda import heads as heads_cuda
from turbospark.layers.cuda import kernel as kernel_module
from turbospark.layers.cuda import norm as norm_cuda
from turbospark.layers.cuda import nvrtc
from turbospark.layers.cuda import qmv as qmv_cuda
from turbospark.layers.cuda import steer as steer_cuda

NVCC = shutil.which("nvcc")


def _has_nvrtc() -> bool:
    try:
        nvrtc.library()
    except OSError:
        return False
    return bool(nvrtc.include_dirs())


# qmv's variants (outputs a warp, unroll, shared x) compiled beside its default:
# the extremes of each knob.
QMV_VARIANTS = [(8, 4, False), (2, 1, True), (8, 2, True)]
# The kernel builders, each cached by its arguments: cleared before and after
# so the recorder's stand-ins never outlive this test.
BUILDERS = [
    norm_cuda._kernel,
    heads_cuda._kernel,
    attention_cuda._partial_kernel,
    attention_cuda._merge_kernel,
    steer_cuda._kernel,
    gdn_cuda._kernel,
    gdn_cuda._decode_kernel,
    qmv_cuda._kernel,
    fmv_cuda._kernel,
]


def _zeros(*shapes: tuple[int, ...], dtype: mx.Dtype) -> list[mx.array]:
    return [mx.zeros(s, dtype=dtype) for s in shapes]


def _call_every_kernel(dtype: mx.Dtype) -> None:
    """Each module's entry at the shapes the families use (and an odd width)."""
    for width, (has_uw, has_scale, has_w) in itertools.product(
        (100, 2048), itertools.product((False, True), repeat=3)
    ):
        h, update, uw, w = _zeros((2, 1, width), (2, 1, width), (width,), (width,), dtype=dtype)
        scale = mx.ones((1,), dtype=dtype)
        norm_cuda.join_norm(
            h,
            update,
            w if has_w else None,
            1e-6,
            uw if has_uw else None,
            scale if has_scale else None,
        )
    for heads, kv_heads, own_values, dim in [
        (8, 2, True, 256),
        (8, 2, False, 512),
        (8, 0, False, 256),
    ]:
        n_in = heads + kv_heads * (2 if own_values else 1)
        x, table = _zeros((3, n_in * dim), (heads + kv_heads, 1, dim), dtype=dtype)
        heads_cuda.norm_rope(x, table, mx.array([5]), mx.ones((dim // 2,)), heads, kv_heads, 1e-6)
    for kv_heads, group, dim in [(2, 4, 512), (2, 8, 256), (1, 4, 64)]:
        q, k, v = _zeros((1, kv_heads * group, 1, dim), *[(1, kv_heads, 300, dim)] * 2, dtype=dtype)
        attention_cuda.decode(q, k, v, mx.array([0, 290], dtype=mx.int32), dim**-0.5)
        q, k, v = _zeros((3, kv_heads * group, 1, dim), *[(3, kv_heads, 300, dim)] * 2, dtype=dtype)
        left = mx.array([0, 4, 9], dtype=mx.int32)  # a batch's: each row past its padding
        attention_cuda.decode(q, k, v, mx.array([0, 290], dtype=mx.int32), dim**-0.5, left)
    for joined in (0, 1, 2):
        h, u, w, update = _zeros(*[(3, 1, 300)] * 4, dtype=dtype)
        coef = mx.zeros((3, 1, 3))
        extra = {"update": update} if joined else {}
        if joined == 2:
            extra["scale"] = mx.ones((1,), dtype=dtype)
        steer_cuda.steer_rows(h, u, w, coef, **extra)
    for dims, keep in itertools.product(GDN_DIMS, (False, True)):
        mixed, proj, rate, state, a_offset = gdn_inputs(2, 3, dims, dtype, seed=0)
        gdn_cuda.gated_delta(mixed, proj, rate, state, *dims, a_offset, keep=keep)
    for dims in GDN_DIMS:
        hk, hv, dk, dv = dims
        conv = 2 * hk * dk + hv * dv
        proj, tail, conv_weight, bias = _zeros(
            (2, 1, conv + hv * dv + 2 * hv), (2, 3, conv), (conv, 4, 1), (conv + hv * dv + 2 * hv,),
            dtype=dtype,
        )  # fmt: skip
        rate, state, norm_weight = _zeros((hv,), (2, hv, dv, dk), (dv,), dtype=mx.float32)
        gdn_cuda.decode_mixer(proj, tail, conv_weight, bias, rate, state, norm_weight, *dims, 1e-6)
    qmv_variants = [None, *(qmv_cuda.Variant(o, u, s) for o, u, s in QMV_VARIANTS)]
    for (bits, group_size, rows), variant in itertools.product(
        [(4, 64, 1), (8, 32, 3), (4, 128, qmv_cuda.R_MAX)], qmv_variants
    ):
        width = 4 * group_size
        w = mx.zeros((5, width * bits // 32), dtype=mx.uint32)
        scales, biases = _zeros(*[(5, width // group_size)] * 2, dtype=dtype)
        x = mx.zeros((rows, 1, width), dtype=dtype)
        assert qmv_cuda.takes(x, w, scales, biases, group_size, bits, "affine")
        qmv_cuda.qmv(x, w, scales, biases, group_size, bits, variant)
    # fmv in both of its dtypes (whatever the loop's), without an addend, with
    # a bias and with a residual, at one warp a block and at several.
    for float_dtype, (rows, width, outputs) in itertools.product(
        fmv_cuda.DTYPES, [(2, 64, 40), (16, 2048, 2048)]
    ):
        x, weight = _zeros((rows, 1, width), (outputs, width), dtype=float_dtype)
        assert fmv_cuda.takes(x, weight.T)
        for addend in (None, mx.zeros((outputs,), float_dtype), mx.zeros((rows, 1, outputs), float_dtype)):  # fmt: skip
            fmv_cuda.fmv(x, weight.T, addend)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Every distinct kernel source the entries build, by its function's
    name; MLX's launch returns zeros of the outputs."""
    kernels: dict[str, str] = {}

    def cubin(name: str, source: str) -> bytes:
        kernels[name] = source
        return b""

    def launch(*, output_shapes: list, output_dtypes: list, **_: Any) -> list[mx.array]:
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

    for builder in BUILDERS:
        builder.cache_clear()
    monkeypatch.setattr(kernel_module, "cubin", cubin)
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch)
    for module in (norm_cuda, heads_cuda, steer_cuda, qmv_cuda, fmv_cuda):
        monkeypatch.setattr(module, "available", lambda: True)
    for dtype in (mx.float32, mx.bfloat16):
        _call_every_kernel(dtype)
    yield kernels
    for builder in BUILDERS:
        builder.cache_clear()


def test_every_entry_builds_its_kernels(recorded: dict[str, str]) -> None:
    # Every builder was reached (a kernel the calls miss is not compiled),
    # each join_norm form and steering join is there, and each attention
    # scale (a literal in the source) is a kernel of its own in each dtype,
    # alone and for a batch (each row past its padding).
    assert all(builder.cache_info().currsize for builder in BUILDERS)
    bases = [re.sub(r"_[0-9a-f]{16}$", "", name) for name in recorded]
    assert len(set(bases)) == 8 + 2 + 1 + 1 + 3 + 2 + 1 + 1 + 3, sorted(set(bases))
    assert bases.count("turbospark_decode_attention") == 3 * 2 * 2
    assert all(f'extern "C" __global__ void {name}(' in text for name, text in recorded.items())


@pytest.mark.slow  # builds every kernel with nvcc: ~7 s on two cores
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_every_kernel_compiles_for_sm90_with_nvcc(recorded: dict[str, str], tmp_path: Path) -> None:
    parts = [kernel_module.PRELUDE]
    for i, text in enumerate(recorded.values()):
        assert text.startswith(kernel_module.PRELUDE)
        parts.append(f"namespace k{i} {{\n{text[len(kernel_module.PRELUDE) :]}}}\n")
    source = tmp_path / "kernels.cu"
    source.write_text("\n".join(parts))
    done = subprocess.run(
        [NVCC, "-arch=sm_90", "-std=c++17", "-cubin", "-o", str(tmp_path / "k.cubin"), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, "\n".join(errors[:20]) or done.stderr[-4000:]


@pytest.mark.skipif(not _has_nvrtc(), reason="needs NVRTC (set TURBOSPARK_NVRTC to libnvrtc.so)")
def test_every_kernel_compiles_for_sm90_with_nvrtc(recorded: dict[str, str]) -> None:
    for name, text in recorded.items():
        assert nvrtc.compile_cubin(text, name, "sm_90").startswith(b"\x7fELF"), name
