"""The one-kernel gated delta rule against the reference recurrence it replaces.

Runs only where MLX has its CUDA backend (the H200 bench machine:
``TURBOSPARK_TEST_DEVICE=gpu python3 -m pytest tests/test_gdn_cuda.py``); on
the CPU and Metal the layers keep the reference forms, which
``tests/test_gated_delta_forms.py`` checks. Whole forwards in
the kernel's form against the reference forms on the same GPU are
``tests/test_prefill_gpu_forms.py`` and ``tests/test_verify_gpu_forms.py``
(their GPU side is the kernel there).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from helpers import GDN_DIMS, gdn_inputs, gdn_reference
from turbospark.layers.cuda import gdn as gdn_cuda

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize("dims", GDN_DIMS)
@pytest.mark.parametrize(("batch", "length"), [(1, 1), (3, 1), (1, 5), (2, 70)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_equals_the_reference_recurrence(
    dims: tuple[int, int, int, int], batch: int, length: int, dtype: mx.Dtype
) -> None:
    mx.set_default_device(mx.gpu)
    mixed, proj, rate, state, a_offset = gdn_inputs(batch, length, dims, dtype, seed=length)
    want_y, want_states = gdn_reference(mixed, proj, rate, state, dims, a_offset)
    y, last = gdn_cuda.gated_delta(mixed, proj, rate, state, *dims, a_offset)
    y_kept, last_kept, kept = gdn_cuda.gated_delta(
        mixed, proj, rate, state, *dims, a_offset, keep=True
    )
    # Float32 math from the same inputs either way: only the order of sums differs.
    tolerance = 2e-4
    np.testing.assert_allclose(np.array(y), np.array(want_y), rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(
        np.array(last), np.array(want_states[:, -1]), rtol=tolerance, atol=tolerance
    )
    np.testing.assert_allclose(
        np.array(kept), np.array(want_states), rtol=tolerance, atol=tolerance
    )
    assert mx.array_equal(y_kept, y) and mx.array_equal(last_kept, last)
    assert mx.array_equal(kept[:, -1], last)


def test_a_row_is_the_same_alone_and_batched_and_chunked() -> None:
    """Rows are independent (a batch's row equals it alone) and a prompt in two
    pieces equals it in one, bit for bit: the kernel rounds each token the same
    way whatever else is in the call."""
    mx.set_default_device(mx.gpu)
    dims = GDN_DIMS[-1]
    mixed, proj, rate, state, a_offset = gdn_inputs(3, 9, dims, mx.bfloat16, seed=7)
    y, last = gdn_cuda.gated_delta(mixed, proj, rate, state, *dims, a_offset)
    alone_y, alone = gdn_cuda.gated_delta(mixed[1:2], proj[1:2], rate, state[1:2], *dims, a_offset)
    assert mx.array_equal(alone_y, y[1:2]) and mx.array_equal(alone, last[1:2])
    first_y, middle = gdn_cuda.gated_delta(mixed[:, :4], proj[:, :4], rate, state, *dims, a_offset)
    rest_y, end = gdn_cuda.gated_delta(mixed[:, 4:], proj[:, 4:], rate, middle, *dims, a_offset)
    assert mx.array_equal(mx.concatenate([first_y, rest_y], axis=1), y)
    assert mx.array_equal(end, last)


@pytest.mark.parametrize("module", ["gdn", "norm", "attention"])
def test_available_follows_the_gpu_forms(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turning the GPU forms off (how the tests get the reference forms on a GPU)
    turns each hand-written kernel off too."""
    import importlib

    from turbospark.layers import fused

    kernels = importlib.import_module(f"turbospark.layers.cuda.{module}")
    mx.set_default_device(mx.gpu)
    assert kernels.available()
    monkeypatch.setattr(fused, "BUILD_FOR_GPU", False)
    assert not kernels.available()


def _mixer_inputs(
    batch: int, dims: tuple[int, int, int, int], dtype: mx.Dtype, seed: int
) -> tuple[mx.array, ...]:
    """Random ``(proj, tail, conv_weight, in_bias, rate, state, norm_weight)`` for
    :func:`~turbospark.layers.cuda.gdn.decode_mixer` (a 4-tap conv)."""
    hk, hv, dk, dv = dims
    rng = np.random.default_rng(seed)
    conv = 2 * hk * dk + hv * dv
    width = conv + hv * dv + 2 * hv  # qkv | z | a | b
    bias = np.zeros(width, np.float32)
    bias[conv + hv * dv : conv + hv * dv + hv] = rng.standard_normal(hv)  # dt_bias at a's columns
    return (
        mx.array(rng.standard_normal((batch, 1, width)), dtype=dtype),
        mx.array(rng.standard_normal((batch, 3, conv)), dtype=dtype),
        mx.array(rng.standard_normal((conv, 4, 1)) * 0.5, dtype=dtype),
        mx.array(bias, dtype=dtype),
        mx.array(-np.exp(rng.standard_normal(hv) * 0.5), dtype=mx.float32),
        mx.array(rng.standard_normal((batch, hv, dv, dk)) * 0.3, dtype=mx.float32),
        mx.array(1 + 0.1 * rng.standard_normal(dv), dtype=mx.float32),
    )


@pytest.mark.parametrize("dims", GDN_DIMS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_decode_mixer_equals_its_ops(
    dims: tuple[int, int, int, int], batch: int, dtype: mx.Dtype
) -> None:
    """The whole decode step between the GEMMs against its specification; the
    new conv tail is a copy, so it is exact."""
    mx.set_default_device(mx.gpu)
    args = _mixer_inputs(batch, dims, dtype, seed=batch)
    out, state, tail = gdn_cuda.decode_mixer(*args, *dims, 1e-6)
    want_out, want_state, want_tail = gdn_cuda.decode_mixer_ops(*args, *dims, 1e-6)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert mx.array_equal(tail, want_tail)
    # Float32: only the order of sums differs. bf16: the conv's and the output's
    # roundings are the ops', but a sum's last bit can move either across one.
    tolerance = 2e-4 if dtype == mx.float32 else 4e-2
    np.testing.assert_allclose(
        np.array(state), np.array(want_state), rtol=tolerance, atol=tolerance
    )
    np.testing.assert_allclose(
        np.array(out.astype(mx.float32)), np.array(want_out.astype(mx.float32)),
        rtol=tolerance, atol=tolerance,
    )  # fmt: skip


def test_the_decode_mixer_rows_are_the_same_alone_and_batched() -> None:
    mx.set_default_device(mx.gpu)
    dims = GDN_DIMS[-1]
    args = _mixer_inputs(3, dims, mx.bfloat16, seed=5)
    batched = gdn_cuda.decode_mixer(*args, *dims, 1e-6)
    row = [a[1:2] if i in (0, 1, 5) else a for i, a in enumerate(args)]
    alone = gdn_cuda.decode_mixer(*row, *dims, 1e-6)
    for got, want in zip(alone, batched, strict=True):
        assert mx.array_equal(got, want[1:2])
