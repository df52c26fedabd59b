"""A residual join and the RMS norms on either side of it as one CUDA kernel.

A decode step on a GPU is bound by its launches, and most of a layer's
launches that are not matmuls are RMS norms and the residual adds between
them: an add is an op of its own wherever a norm (a reduction, which
``mx.compile`` does not fuse) stands on either side of it. A Gemma layer's
``h + post_norm(attn)`` then ``pre_norm(h)`` is three kernels, a Qwen
layer's ``x + o_proj(...)`` then ``post_norm(h)`` two, and each layer's last
join meets the next layer's input norm the same way. Here one block owns one
row and does all of it:

    u = rms_norm(update, update_weight)   (when update_weight is given)
    s = (h + u) * scale                   (scale when given)
    y = rms_norm(s, weight)               (when weight is given)

returning ``(s, y)``. Each step rounds to the activations' dtype where the ops
do (``mx.fast.rms_norm`` casts the normalised row before the weight's
multiply, a compiled ``(h + u) * scale`` rounds the sum), so the kernel
differs from its ops only in the order of a row's float32 sum of squares.

:class:`Unjoined` carries a layer's output as ``h`` and the update not yet
added, so that the next layer's input norm (or the final norm) joins it in
its own kernel. :func:`join_norm_ops` is the contract in MLX ops: what runs
everywhere else, and the CPU tests' stand-in for the kernel
(``tests/test_norm_kernel_path.py``; ``tests/test_norm_cuda.py`` checks the
kernel against it on a GPU).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import mlx.core as mx

from turbospark.layers import fused
from turbospark.layers.cuda import reduce as reduce_cuda
from turbospark.layers.cuda.kernel import Kernel

# TURBOSPARK_NORM_KERNEL=0 keeps the ops forms on CUDA too (the benchmarks'
# A/B, as TURBOSPARK_GDN_KERNEL), read once at import.
ENABLED = os.environ.get("TURBOSPARK_NORM_KERNEL", "1") != "0"


class Unjoined(NamedTuple):
    """A layer's output before its last residual join: the stream is
    ``(h + rms_norm(update, update_weight)) * scale`` (each part only when
    given), left for the next norm to compute in the same kernel."""

    h: mx.array
    update: mx.array
    update_weight: mx.array | None = None
    scale: mx.array | None = None
    eps: float = 0.0  # update_weight's norm's

    @property
    def shape(self) -> tuple[int, ...]:
        return self.h.shape

    def last(self) -> Unjoined:
        """The last token's row of every part (a join is per token)."""
        return self._replace(h=self.h[:, -1:], update=self.update[:, -1:])


def available() -> bool:
    """True where the families take this kernel (:func:`~turbospark.layers.fused.takes_cuda_kernels`)."""
    return fused.takes_cuda_kernels(ENABLED)


# One block a row of H; every thread holds PER of the row's values in registers.
# T is the activations' dtype, which every input shares (join_norm checks). The
# parts in braces are spliced in only for the kernels that have those inputs.
# Every input is read into registers before anything is computed, so the
# loads overlap: read where each is first used, after a reduction's
# __syncthreads or a store, each waited a memory latency of its own in turn
# (3.8-5.2 us a call on the H200, against 2.0-2.8 us reading all first).
_SOURCE = """
    constexpr int PER = (H + BLOCK - 1) / BLOCK;
    __shared__ float scratch[BLOCK / 32];
    const size_t base = static_cast<size_t>(blockIdx.x) * H;
    const int tid = threadIdx.x;
    float u[PER], x[PER];
    {DECLARE}
    for (int i = 0; i < PER; ++i) {
        const int j = tid + BLOCK * i;
        const bool in = j < H;
        u[i] = in ? static_cast<float>(update[base + j]) : 0.0f;
        x[i] = in ? static_cast<float>(h[base + j]) : 0.0f;
        {LOAD}
    }
    {NORM_UPDATE}
    for (int i = 0; i < PER; ++i) {
        const int j = tid + BLOCK * i;
        if (j >= H) continue;
        T s = static_cast<T>(x[i] + u[i]);
        {SCALE}
        joined[base + j] = s;
        u[i] = static_cast<float>(s);
    }
    {NORM_JOINED}
"""
_NORM_UPDATE = """{
        float squares = 0.0f;
        for (int i = 0; i < PER; ++i) squares += u[i] * u[i];
        const float inv = rsqrtf(block_sum<BLOCK>(squares, scratch) / H + EPS);
        for (int i = 0; i < PER; ++i) u[i] = static_cast<float>(uw[i] * static_cast<T>(u[i] * inv));
    }"""
_SCALE = "s = s * factor;"
_NORM_JOINED = """{
        float squares = 0.0f;
        for (int i = 0; i < PER; ++i) squares += u[i] * u[i];
        const float inv = rsqrtf(block_sum<BLOCK>(squares, scratch) / H + EPS);
        for (int i = 0; i < PER; ++i) {
            const int j = tid + BLOCK * i;
            if (j < H) normed[base + j] = w[i] * static_cast<T>(u[i] * inv);
        }
    }"""


def source(has_uw: bool, has_scale: bool, has_w: bool, eps: float) -> str:
    """The kernel body for one set of inputs (``eps`` a literal of it)."""
    declare = (
        "T uw[PER];" * has_uw + " T w[PER];" * has_w + " const T factor = scale[0];" * has_scale
    )
    zero = "static_cast<T>(0.0f)"  # past the row: a value the norms multiply, never NaN
    load = (
        f"uw[i] = in ? update_weight[j] : {zero};" * has_uw
        + f" w[i] = in ? weight[j] : {zero};" * has_w
    )
    return fused.eps_constant(eps)[0] + (
        _SOURCE.replace("{DECLARE}", declare)
        .replace("{LOAD}", load)
        .replace("{NORM_UPDATE}", _NORM_UPDATE if has_uw else "")
        .replace("{SCALE}", _SCALE if has_scale else "")
        .replace("{NORM_JOINED}", _NORM_JOINED if has_w else "")
    )


def _block(width: int) -> int:
    """Threads a row: about eight values each, a warp at least, 1,024 at most."""
    threads = 32
    while threads < 1024 and threads * 8 < width:
        threads *= 2
    return threads


@functools.cache
def _kernel(has_uw: bool, has_scale: bool, has_w: bool, eps: float) -> Kernel:
    flags = f"{int(has_uw)}{int(has_scale)}{int(has_w)}"
    inputs = ["h", "update"] + ["update_weight"] * has_uw + ["scale"] * has_scale
    return Kernel(
        name=f"turbospark_join_norm_{flags}_{fused.eps_constant(eps)[1]}",
        input_names=[*inputs, *["weight"] * has_w],
        output_names=["joined", "normed"] if has_w else ["joined"],
        source=source(has_uw, has_scale, has_w, eps),
        header=reduce_cuda.HEADER,
    )


def join_norm_ops(
    h: mx.array,
    update: mx.array,
    weight: mx.array | None,
    eps: float,
    update_weight: mx.array | None = None,
    scale: mx.array | None = None,
) -> tuple[mx.array, mx.array | None]:
    """The kernel's contract in MLX ops (the module docstring): the joined
    stream and, with *weight*, its RMS norm (else None)."""
    if update_weight is not None:
        update = mx.fast.rms_norm(update, update_weight, eps)
    joined = h + update if scale is None else fused.residual_scale(h, update, scale)
    return joined, None if weight is None else mx.fast.rms_norm(joined, weight, eps)


def join_norm(
    h: mx.array,
    update: mx.array,
    weight: mx.array | None,
    eps: float,
    update_weight: mx.array | None = None,
    scale: mx.array | None = None,
) -> tuple[mx.array, mx.array | None]:
    """:func:`join_norm_ops` in one kernel where :func:`available` (every
    array of the activations' dtype), else in its ops."""
    parts = [x for x in (update_weight, scale, weight) if x is not None]
    if not available() or any(x.dtype != h.dtype for x in (update, *parts)):
        return join_norm_ops(h, update, weight, eps, update_weight, scale)
    width = h.shape[-1]
    block = _block(width)
    outs = _kernel(update_weight is not None, scale is not None, weight is not None, eps)(
        inputs=[h, update, *parts],
        template=[("H", width), ("BLOCK", block), ("T", h.dtype)],
        grid=(h.size // width * block, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[h.shape] * (1 + (weight is not None)),
        output_dtypes=[h.dtype] * (1 + (weight is not None)),
    )
    return outs[0], outs[1] if weight is not None else None


def _join_norm_traced(
    h: mx.array,
    update: mx.array,
    weight: mx.array | None,
    eps: float,
    update_weight: mx.array | None,
    scale: mx.array | None,
) -> tuple[mx.array, ...]:
    # Only arrays leave a compiled function: the norm only when there is one.
    joined, normed = join_norm(h, update, weight, eps, update_weight, scale)
    return (joined,) if normed is None else (joined, normed)


_join_norm_step = mx.compile(_join_norm_traced)


def join_norm_step(
    h: mx.array,
    update: mx.array,
    weight: mx.array | None,
    eps: float,
    update_weight: mx.array | None = None,
    scale: mx.array | None = None,
) -> tuple[mx.array, mx.array | None]:
    """:func:`join_norm` for a call outside the families' compiled step
    functions: compiled itself for the forwards they compile
    (:func:`~turbospark.layers.fused.runs_compiled`), since MLX builds a custom
    kernel's whole source string on every call and a compiled trace replays
    the kernel it built once (uncompiled, ``join_norm``'s own time was 67 ms
    of the decode steps' 1,491 ms in a 16-client gemma4 ``server_step`` on the
    H200; :func:`normed_input` called it outside any trace)."""
    if not fused.runs_compiled(*h.shape[:2]):
        return join_norm(h, update, weight, eps, update_weight, scale)
    outs = _join_norm_step(h, update, weight, eps, update_weight, scale)
    return outs[0], outs[1] if len(outs) == 2 else None


def normed_input(x: mx.array | Unjoined, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """A layer's input stream (or the final norm's) and its RMS norm: a plain
    ``mx.fast.rms_norm`` of a joined stream, or for an :class:`Unjoined` one,
    the join and the norm in one :func:`join_norm`."""
    if isinstance(x, Unjoined):
        if x.update_weight is not None and x.eps != eps:
            raise ValueError(f"one kernel has one eps: the update's {x.eps}, the norm's {eps}")
        return join_norm_step(x.h, x.update, weight, eps, x.update_weight, x.scale)
    return x, mx.fast.rms_norm(x, weight, eps)
