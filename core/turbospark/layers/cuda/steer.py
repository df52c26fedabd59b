"""One layer's steering as a single CUDA kernel, for one-token decode steps.

On the GPU a decode step is launch-bound (hundreds of small kernels), and
``renorm``, ``ablate`` and ``clamp`` need reductions over the hidden axis that
``mx.compile`` cannot fuse with the elementwise work around them: as compiled
MLX ops they cost several launches per steered layer (measured: ``renorm``
at 0.73–0.85x of ``off`` on an H200, against ``add``'s single op). Here each
token row is one thread block that reads ``h`` once, reduces ``h.h``, ``h.u``
and (for ``renorm``) ``h'.h'`` in registers and shared memory, and writes the
steered row: one launch per layer for every mode, like ``add``. Handed a
family's last residual join (:func:`turbospark.policies.steering.joiner`), the kernel
computes the join too, rounding as the join's own kernel does, so a steered
layer costs no launch beyond the unsteered one in any mode.

The math is :func:`turbospark.policies.steering._kernel`'s, accumulated in float32 and
rounded to the model's dtype once at the end (the compiled ops round after
each op), so in bfloat16 the two paths differ in the last bit; float32 agrees
to rounding. Only the CUDA backend has it: Metal and the CPU run the compiled
ops.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from turbospark.layers.cuda import reduce as reduce_cuda
from turbospark.layers.cuda.kernel import Kernel

THREADS = 256  # threads per block (one block per token row)

# Inputs: h (B, H) the layer's output for one token per row, or in a joined
# kernel (_JOINED) the residual h and the update whose join (h + update, or
# (h + update) * layer_scale with a (1,) layer_scale) is that output; u, w (B, H) the unit direction and the added
# vector, in h's dtype; coef (B, 3) float32: a (1 where the component along u is
# replaced), t (what replaces it), r (1 where the row renormalises). A row of
# zeros is the identity, exactly.
_SOURCE = """
    constexpr int N = (H + TPB - 1) / TPB;
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T* hr = h + row * H;
    const T* ur = u + row * H;
    const T* wr = w + row * H;
    float x[N];
    float hh = 0.0f, hu = 0.0f;
    for (int i = 0; i < N; ++i) {
        int j = threadIdx.x + i * TPB;
        x[i] = 0.0f;
        if (j < H) {
            x[i] = static_cast<float>(hr[j]);
            /*JOIN*/
            hh += x[i] * x[i];
            hu += x[i] * static_cast<float>(ur[j]);
        }
    }
    hh = block_sum<TPB>(hh, shared);
    hu = block_sum<TPB>(hu, shared);
    const float a = coef[row * 3], t = coef[row * 3 + 1], r = coef[row * 3 + 2];
    const float along = a * (hu - t);
    float oo = 0.0f;
    for (int i = 0; i < N; ++i) {
        int j = threadIdx.x + i * TPB;
        if (j < H) {
            x[i] = x[i] - along * static_cast<float>(ur[j]) + static_cast<float>(wr[j]);
            oo += x[i] * x[i];
        }
    }
    float scale = 1.0f;
    if (r != 0.0f) {
        oo = block_sum<TPB>(oo, shared);
        scale = sqrtf(hh / oo);
    }
    for (int i = 0; i < N; ++i) {
        int j = threadIdx.x + i * TPB;
        if (j < H) out[row * H + j] = static_cast<T>(x[i] * scale);
    }
"""


def available() -> bool:
    """True where the default device runs this kernel (MLX's CUDA backend)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


# The join, rounded after each op as the join's own kernel rounds, spliced in
# where x[i] holds h (only the joined kernels have `update` and `layer_scale`).
_ADD = "x[i] = static_cast<float>(static_cast<T>(x[i] + static_cast<float>(update[row * H + j])));"
_SCALE = "x[i] = static_cast<float>(static_cast<T>(x[i] * static_cast<float>(layer_scale[0])));"
_JOINED = {
    None: (["h", "u", "w", "coef"], ""),
    1: (["h", "update", "u", "w", "coef"], _ADD),
    2: (["h", "update", "layer_scale", "u", "w", "coef"], _ADD + "\n" + _SCALE),
}


@functools.cache
def _kernel(join: int | None) -> Kernel:
    names, code = _JOINED[join]
    return Kernel(
        name=f"turbospark_steer{join or ''}",
        input_names=names,
        output_names=["out"],
        source=_SOURCE.replace("/*JOIN*/", code),
        header=reduce_cuda.HEADER,
    )


def steer_rows(
    h: mx.array,
    u: mx.array,
    w: mx.array,
    coef: mx.array,
    update: mx.array | None = None,
    scale: mx.array | None = None,
) -> mx.array:
    """Steer ``h`` ``(B, 1, H)``, or with *update* the join ``(h + update) * scale``
    (no *scale*: ``h + update``): one launch. *u*, *w* ``(B, 1, H)`` in ``h``'s
    dtype, *coef* ``(B, 1, 3)`` float32 (``a``, ``t``, renormalise), as built by
    :meth:`turbospark.policies.steering.Steer.of`; *scale* a one-element array."""
    rows, hidden = h.shape[0], h.shape[-1]
    join = None if update is None else 1 if scale is None else 2
    joined = [] if update is None else [update] if scale is None else [update, scale]
    (out,) = _kernel(join)(
        inputs=[h, *joined, u, w, coef],
        template=[("T", h.dtype), ("H", hidden), ("TPB", THREADS)],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[h.shape],
        output_dtypes=[h.dtype],
    )
    return out
