"""Elementwise chains compiled into one kernel each, shared by the families.

Decode (one token per row) is launch-bound on a GPU: every MLX primitive that
is not a view is a kernel, and a layer's matmuls are few next to its gates,
residuals and scales. ``mx.compile(shapeless=True)`` fuses each chain below
into one kernel for every shape, so decode, prefill and any batch size share
one trace and nothing recompiles as positions or batches change. The math is
the uncompiled expression, op for op (``mx.disable_compile()`` runs exactly
that, which is how the tests compare the two).
"""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx
import mlx.nn as nn

STEP_TOKENS = 8  # a lone row's forwards up to this long take the compiled step functions

# None: the decode step takes its GPU forms on a GPU (builds_for_gpu); True makes
# the CPU build them too, which is how bench/gpu_kernels.py counts a GPU's kernels.
BUILD_FOR_GPU: bool | None = None


def builds_for_gpu() -> bool:
    """Whether the decode step takes the forms that cost a GPU fewer kernels
    (one-query attention by matmuls, the gated-delta step's products as
    matmuls). On the CPU kernels are cheap and each small BLAS call costs more
    than the reductions it replaces (OpenBLAS wakes its threads for it), so
    there the step keeps the reference forms. Read when a step is traced."""
    return mx.default_device() == mx.gpu if BUILD_FOR_GPU is None else BUILD_FOR_GPU


def takes_cuda_kernels(enabled: bool) -> bool:
    """Whether the layers take their hand-written CUDA kernels (gdn_cuda,
    norm_cuda), given that kernel's switch: MLX's CUDA backend is the default
    device and the step takes a GPU's forms (:func:`builds_for_gpu`; tests turn
    those off on a GPU to compare against the reference forms)."""
    return enabled and builds_for_gpu() and mx.default_device() == mx.gpu and mx.cuda.is_available()


def eps_constant(eps: float) -> tuple[str, str]:
    """*eps* as a literal of a hand-written CUDA kernel's source (gdn_cuda,
    norm_cuda): the line that declares ``EPS``, and a suffix for the kernel's
    name, which must carry it too: MLX caches a kernel by its name and
    template only, so two sources that differ in a literal need two names."""
    literal = repr(float(eps))
    return f"    constexpr float EPS = {literal}f;\n", "eps" + literal.replace(".", "p").replace(
        "-", "m"
    )


def runs_compiled(batch: int, length: int) -> bool:
    """Whether a forward over ``(batch, length)`` tokens takes the families'
    compiled step functions (whole dense halves, the gated-DeltaNet mix), which
    trace once per shape: every decode step (one token a row), and a lone
    row's short forward, which is what a draft's verify pass is (``k + 1``
    tokens) and where a launch-bound GPU pays most for uncompiled ops. Longer
    or batched multi-token forwards (prefill chunks) run the same functions
    uncompiled, so their lengths never trace: at most :data:`STEP_TOKENS`
    shapes beyond one per batch size."""
    return length == 1 or (batch == 1 and length <= STEP_TOKENS)


# tanh as an odd rational function of x on [-CLAMP, CLAMP] (numerator x times a
# degree-6 polynomial in x^2, denominator degree 3 in x^2; Eigen's float
# approximation, the one XLA's CPU backend emits): within 4e-7 of MLX's tanh
# everywhere (tests/test_fused.py), and past the clamp tanh is 1 in float32.
_TANH_CLAMP = 7.90531110763549805
_TANH_NUMERATOR = (  # x^1, x^3, ..., x^13
    4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
    -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16,
)  # fmt: skip
_TANH_DENOMINATOR = (  # x^0, x^2, x^4, x^6
    4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06,
)  # fmt: skip
_GELU_SCALE = math.sqrt(2 / math.pi)


def _horner(x2: mx.array, coefficients: tuple[float, ...]) -> mx.array:
    out = mx.array(coefficients[-1], x2.dtype)
    for c in reversed(coefficients[:-1]):
        out = out * x2 + c
    return out


def _rational(x: mx.array) -> bool:
    """Whether *x* takes the rational tanh: float32 on the CPU (see :func:`tanh`)."""
    return x.dtype == mx.float32 and mx.default_device() == mx.cpu


def tanh(x: mx.array) -> mx.array:
    """``mx.tanh``, except for float32 on the CPU: there MLX (0.32, Linux)
    evaluates tanh with libm's scalar ``tanhf``, about 25 ns an element, so a
    batched Gemma decode step spent about a tenth of its time in the MLP's
    GELU (bench/README.md, "GELU without libm"); the rational form is plain
    multiply-adds and one divide, which a compiled kernel runs about 4x faster.
    Other dtypes and devices keep MLX's tanh: a GPU's is fast, and a
    polynomial rounded at every step in bf16 would lose the precision.
    Decided when traced (dtype and default device)."""
    if not _rational(x):
        return mx.tanh(x)
    x = mx.clip(x, -_TANH_CLAMP, _TANH_CLAMP)
    x2 = x * x
    return x * _horner(x2, _TANH_NUMERATOR) / _horner(x2, _TANH_DENOMINATOR)


def gelu_approx(x: mx.array) -> mx.array:
    """``mlx.nn.gelu_approx`` (GELU, tanh form), through :func:`tanh`; the
    cube as two products, where ``x**3`` is libm's scalar ``powf`` on the CPU."""
    if not _rational(x):
        return nn.gelu_approx(x)
    return 0.5 * x * (1 + tanh(_GELU_SCALE * (x + 0.044715 * (x * x * x))))


def silu(x: mx.array) -> mx.array:
    """``mlx.nn.silu``; on the CPU in float32 through :func:`tanh`
    (``sigmoid(x) = (1 + tanh(x / 2)) / 2``), where MLX's sigmoid costs about
    16 ns an element (its ``exp`` calls libm's ``fmaf`` out of line)."""
    if not _rational(x):
        return nn.silu(x)
    return 0.5 * x * (1 + tanh(0.5 * x))


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` (Llama, Qwen feed-forward)."""
    return silu(gate) * up


@partial(mx.compile, shapeless=True)
def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_tanh(gate) * up`` (Gemma feed-forward and per-layer-input gate)."""
    return gelu_approx(gate) * up


@partial(mx.compile, shapeless=True)
def sigmoid_gate(x: mx.array, gate: mx.array) -> mx.array:
    """``x * sigmoid(gate)`` (Qwen's gated attention output)."""
    return x * mx.sigmoid(gate)


@partial(mx.compile, shapeless=True)
def residual_scale(h: mx.array, update: mx.array, scale: mx.array) -> mx.array:
    """``(h + update) * scale``: a residual add and a per-layer scalar in one pass."""
    return (h + update) * scale


@partial(mx.compile, shapeless=True)
def softcap(logits: mx.array, cap: float) -> mx.array:
    """``tanh(logits / cap) * cap`` (Gemma's final logit softcap) in the
    logits' dtype, returned as float32 (what the runner reads), so the cast is
    part of the same kernel, not one more."""
    return (tanh(logits / cap) * cap).astype(mx.float32)
