"""Every hand-written CUDA kernel compiles for the H200 (sm_90), on a machine without a GPU.

The kernels run only on MLX's CUDA backend (``tests/test_*_cuda.py``, on the
bench machine), so without this an edit to one goes untested until a device
session, which is short and often spent. Here each kernel module's entry is
called on the CPU with ``mx.fast.cuda_kernel`` replaced by a recorder. The
recorder keeps what MLX would be given: the kernel's name, source, header,
inputs' names and dtypes, and template. Each distinct kernel is then written
out the way MLX's CUDA backend wraps a source: a ``__global__`` function
whose inputs are typed pointers, each with ``_shape``, ``_strides`` and
``_ndim`` beside it, under the kernel's template parameters, after its
header. One translation unit holds them all, each kernel in its own
namespace, and nvcc compiles it. Skipped where nvcc is absent.

The wrapper is close to MLX's, not MLX's own, so this catches a source that
does not compile (a typo, a missing header function, a type error), not a
launch that fails. The GPU tests still decide correctness.
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
from turbospark.layers.cuda import gdn as gdn_cuda
from turbospark.layers.cuda import heads as heads_cuda
from turbospark.layers.cuda import norm as norm_cuda
from turbospark.layers.cuda import qmv as qmv_cuda
from turbospark.layers.cuda import steer as steer_cuda

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")

C_TYPES = {
    mx.float32: "float",
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
}
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
]


def _recorder(kernels: dict[tuple, dict[str, Any]]) -> Any:
    """A stand-in for ``mx.fast.cuda_kernel`` whose kernels record each call
    in *kernels* (by name and template) and return zeros of the outputs."""

    def cuda_kernel(
        name: str,
        input_names: list[str],
        output_names: list[str],
        source: str,
        header: str = "",
        **_: Any,
    ) -> Any:
        def call(
            inputs: list[mx.array],
            template: list[tuple[str, Any]],
            output_shapes: list[tuple[int, ...]],
            output_dtypes: list[mx.Dtype],
            **_: Any,
        ) -> list[mx.array]:
            key = (name, tuple((k, str(v)) for k, v in template))
            kernels[key] = {
                "name": name,
                "source": source,
                "header": header,
                "inputs": list(zip(input_names, (x.dtype for x in inputs), strict=True)),
                "outputs": list(zip(output_names, output_dtypes, strict=True)),
                "template": template,
            }
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return call

    return cuda_kernel


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


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[tuple, dict[str, Any]]]:
    kernels: dict[tuple, dict[str, Any]] = {}
    for builder in BUILDERS:
        builder.cache_clear()
    monkeypatch.setattr(mx.fast, "cuda_kernel", _recorder(kernels))
    for module in (norm_cuda, heads_cuda, steer_cuda, qmv_cuda):
        monkeypatch.setattr(module, "available", lambda: True)
    yield kernels
    for builder in BUILDERS:
        builder.cache_clear()


def _translation_unit(kernels: list[dict[str, Any]]) -> str:
    """*kernels* as one .cu, each call's kernel in a namespace of its own (the
    headers repeat) with its inputs' own types, as MLX builds one source a
    template: its template instantiated once."""
    parts = ["#include <cstdint>", "#include <cuda_bf16.h>", "#include <cuda_fp16.h>"]
    for i, kernel in enumerate(kernels):
        template = kernel["template"]
        params = [
            f"typename {k}"
            if isinstance(v, mx.Dtype)
            else f"bool {k}"
            if isinstance(v, bool)
            else f"int {k}"
            for k, v in template
        ]
        args = [C_TYPES[v] if isinstance(v, mx.Dtype) else str(v).lower() for _, v in template]
        signature = []
        for name, dtype in kernel["inputs"]:
            signature += [
                f"const {C_TYPES[dtype]}* {name}",
                f"const int32_t* {name}_shape",
                f"const int64_t* {name}_strides",
                f"int {name}_ndim",
            ]
        signature += [f"{C_TYPES[dtype]}* {name}" for name, dtype in kernel["outputs"]]
        function = re.sub(r"\W", "_", kernel["name"])
        parts += [
            f"namespace k{i} {{",
            kernel["header"],
            f"template <{', '.join(params)}>" if params else "",
            f"__global__ void {function}({', '.join(signature)}) {{\n{kernel['source']}\n}}",
            f"void* keep = (void*)&{function}<{', '.join(args)}>;" if params else "",
            "}",
        ]
    return "\n".join(parts) + "\n"


@pytest.mark.slow  # builds every kernel with nvcc: ~7 s on two cores
def test_every_kernel_compiles_for_sm90(
    recorded: dict[tuple, dict[str, Any]], tmp_path: Path
) -> None:
    for dtype in (mx.float32, mx.bfloat16):
        _call_every_kernel(dtype)
    # Every builder was reached (a kernel the calls above miss is not compiled),
    # and each join_norm form, attention scale and steering join is there.
    assert all(builder.cache_info().currsize for builder in BUILDERS)
    names = {name for name, _ in recorded}
    assert len(names) == 8 + 2 + 3 + 1 + 3 + 2 + 1 + 1, sorted(names)
    source = tmp_path / "kernels.cu"
    source.write_text(_translation_unit(list(recorded.values())))
    done = subprocess.run(
        [
            NVCC,
            "-arch=sm_90",
            "-std=c++17",
            "-cubin",
            "-o",
            str(tmp_path / "kernels.cubin"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
