"""The decode step's attention kernels against attention computed in float64.

Runs only where MLX has its CUDA backend (the H200 bench machine:
``TURBOSPARK_TEST_DEVICE=gpu python3 -m pytest tests/test_attention_cuda.py``);
on the CPU and Metal a decode step keeps MLX's attention. Whole forwards with
the kernels against the reference forms on the same GPU are
``tests/test_verify_gpu_forms.py`` and ``tests/test_prefill_gpu_forms.py``
(their decode steps after a prefill or a cut); that the kernels follow the
GPU forms' switch is ``tests/test_gdn_cuda.py``'s. The last test here runs
each family's layer traces (Gemma 4's and qwen_gdn's), which call the
kernels inside traces of their own, against its modules' path with the same
kernels.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import assert_states_close, greedy_both_paths, kind_install, state_arrays
from turbospark.generation.runner import Runner
from turbospark.layers.cuda import attention as attention_cuda
from turbospark_gemma4 import model as gemma4_model
from turbospark_qwen_gdn import model as qwen_model

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")

# (batch, kv_heads, group, D, Dv, buffer rows, start, stop): one key; Gemma 4's
# sliding and global layers at their large sizes (2 key heads of 4 queries, D
# 256 and 512) with rows past the last one; Qwen's (8 queries a key head); many
# query heads on one key head, D 64, a window's start; chunk edges; more chunks
# than a merge block has threads (each thread takes several in its max and sum).
SHAPES = [
    (1, 2, 4, 256, 256, 256, 0, 1),
    (1, 2, 4, 256, 256, 768, 256, 767),
    (1, 2, 4, 512, 512, 2304, 0, 2176),
    (1, 2, 8, 256, 256, attention_cuda.CHUNK, 0, attention_cuda.CHUNK),
    (2, 2, 8, 256, 256, 256, 0, attention_cuda.CHUNK + 1),
    (3, 1, 32, 64, 64, 300, 3, 100),
    (1, 1, 4, 64, 64, 40000, 5, 39000),
]


def _inputs(
    shape: tuple[int, ...], dtype: mx.Dtype, seed: int
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    batch, kv_heads, group, dim, value_dim, capacity, start, stop = shape
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    queries = mx.random.normal((batch, kv_heads * group, 1, dim), key=kq).astype(dtype)
    keys = mx.random.normal((batch, kv_heads, capacity, dim), key=kk).astype(dtype)
    values = mx.random.normal((batch, kv_heads, capacity, value_dim), key=kv).astype(dtype)
    return queries, keys, values, mx.array([start, stop], dtype=mx.int32)


def _reference(
    queries: mx.array, keys: mx.array, values: mx.array, rows: mx.array, scale: float
) -> np.ndarray:
    """Softmax attention in float64 over *rows*, from the inputs as given (already rounded)."""
    start, stop = rows.tolist()
    q, k, v = (
        np.array(x.astype(mx.float32)).astype(np.float64)
        for x in (queries, keys[:, :, start:stop], values[:, :, start:stop])
    )
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = scale * q @ k.swapaxes(-1, -2)  # (B, H, 1, T)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


def _tolerance(dtype: mx.Dtype) -> float:
    # Float32 sums in another order, or the output rounded once to bf16 (2^-8 relative).
    return 2e-5 if dtype == mx.float32 else 1e-2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_equals_attention_in_float64(shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    mx.set_default_device(mx.gpu)
    queries, keys, values, rows = _inputs(shape, dtype, seed=shape[-1])
    scale = shape[3] ** -0.5
    got = attention_cuda.decode(queries, keys, values, rows, scale)
    assert got.shape == (shape[0], shape[1] * shape[2], 1, shape[4]) and got.dtype == dtype
    tol = _tolerance(dtype)
    want = _reference(queries, keys, values, rows, scale)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=tol, atol=tol)
    ops = attention_cuda.decode_ops(queries, keys, values, rows, scale)
    np.testing.assert_allclose(np.array(ops.astype(mx.float32)), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("max_splits", [1, 7, 64])
def test_longer_chunks_equal_attention_in_float64(
    max_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With at most *max_splits* chunks a head (``TURBOSPARK_ATTENTION_SPLITS``),
    chunks grow past CHUNK keys and the result is the same attention: one chunk
    of every key, chunks whose last one is short, and a long buffer."""
    mx.set_default_device(mx.gpu)
    monkeypatch.setattr(attention_cuda, "MAX_SPLITS", max_splits)
    for shape in [(1, 2, 4, 512, 512, 2304, 0, 2176), (1, 1, 4, 64, 64, 40000, 5, 39000)]:
        queries, keys, values, rows = _inputs(shape, mx.float32, seed=max_splits)
        scale = shape[3] ** -0.5
        assert attention_cuda.chunk_keys(shape[5]) > attention_cuda.CHUNK
        got = attention_cuda.decode(queries, keys, values, rows, scale)
        want = _reference(queries, keys, values, rows, scale)
        tol = _tolerance(mx.float32)
        np.testing.assert_allclose(np.array(got), want, rtol=tol, atol=tol)


def test_the_trace_serves_every_position_and_reads_only_its_rows() -> None:
    """:data:`~turbospark.layers.cuda.attention.decode_step` traced at one
    position gives what the eager kernels give at others, bit for bit, with
    the same buffers; what lies outside the rows never reaches the output;
    queries as a slice of the joint heads read in place."""
    mx.set_default_device(mx.gpu)
    queries, keys, values, _ = _inputs((1, 2, 4, 256, 256, 768, 0, 0), mx.bfloat16, seed=3)
    joint = mx.concatenate([queries, mx.zeros_like(queries[:, :2])], axis=1)
    for start, stop in [(0, 1), (0, 300), (45, 556), (256, 767)]:
        rows = mx.array([start, stop], dtype=mx.int32)
        eager = attention_cuda.decode(queries, keys, values, rows, 1.0)
        assert mx.array_equal(
            attention_cuda.decode_step(joint[:, :8], keys, values, rows, 1.0), eager
        )
        outside = (mx.arange(768) < start) | (mx.arange(768) >= stop)
        hidden = outside[None, None, :, None]
        noisy = attention_cuda.decode(
            queries, mx.where(hidden, 1e3, keys), mx.where(hidden, -1e3, values), rows, 1.0
        )
        assert mx.array_equal(noisy, eager)


def test_a_row_is_the_same_alone_and_batched() -> None:
    """Rows are computed apart: a batch's row equals that row alone, bit for bit."""
    mx.set_default_device(mx.gpu)
    queries, keys, values, rows = _inputs((3, 2, 4, 256, 256, 512, 0, 300), mx.bfloat16, seed=5)
    batched = attention_cuda.decode(queries, keys, values, rows, 1.0)
    alone = attention_cuda.decode(queries[1:2], keys[1:2], values[1:2], rows, 1.0)
    assert mx.array_equal(alone, batched[1:2])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_each_row_from_its_own_first_row(dtype: mx.Dtype) -> None:
    """A batch's step (``left``: each row's first column past its padding):
    each row equals attention in float64 over its own rows, and that row
    alone with its rows as the pair, bit for bit; the padding never reaches
    the output. Rows padded less than, as much as and more than the start,
    one with a single key."""
    mx.set_default_device(mx.gpu)
    shape = (4, 2, 4, 256, 256, 512, 40, 300)
    queries, keys, values, rows = _inputs(shape, dtype, seed=7)
    left = mx.array([0, 40, 120, 299], dtype=mx.int32)
    got = attention_cuda.decode(queries, keys, values, rows, 1.0, left)  # a batch's call
    padding = (mx.arange(512)[None] < left[:, None])[:, None, :, None]  # (B, 1, N, 1)
    noisy = attention_cuda.decode(
        queries, mx.where(padding, 1e3, keys), mx.where(padding, -1e3, values), rows, 1.0, left
    )
    assert mx.array_equal(noisy, got)
    tol = _tolerance(dtype)
    for b, first in enumerate(left.tolist()):
        own = mx.array([max(40, first), 300], dtype=mx.int32)
        one = (queries[b : b + 1], keys[b : b + 1], values[b : b + 1], own)
        want = _reference(*one, 1.0)
        np.testing.assert_allclose(
            np.array(got[b : b + 1].astype(mx.float32)), want, rtol=tol, atol=tol
        )
        assert mx.array_equal(attention_cuda.decode(*one, 1.0), got[b : b + 1])


# family: (dims, its DecoderLayer, the method that takes the layer traces)
LAYER_TRACES = {
    "gemma4": ({"num_layers": 4, "sliding_window": 8}, gemma4_model.DecoderLayer, "_layer_step"),
    "qwen_gdn": ({"num_layers": 4}, qwen_model.DecoderLayer, "_layer_step"),
}


@pytest.mark.parametrize("family", list(LAYER_TRACES))
def test_layer_traces_equal_the_modules_path(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A family's decode step in its layer traces (gemma4's
    ``DecoderLayer._layer_step`` and qwen_gdn's) against its
    modules' path with the same kernels, float32, over a window's trim and a
    grown buffer: every step's logits, the state after, and greedy tokens
    (with a drafter whose rejected drafts rewind)."""
    mx.set_default_device(mx.gpu)
    dims, layer, method = LAYER_TRACES[family]
    install = kind_install(tmp_path / family, family, dims)
    real = getattr(layer, method)

    def take(traces: bool) -> None:
        monkeypatch.setattr(layer, method, real if traces else lambda *a: None)

    def open_runner(path: Path, **kwargs) -> Runner:
        return Runner.open(path, context_length=1024, dtype="float32", **kwargs)

    prompt = [3 + (5 * i) % 97 for i in range(254)]
    runs = []
    for traces in (False, True):
        take(traces)
        runner = open_runner(install)
        runner.prefill_chunk(prompt, 0)
        steps = [runner.produce(5 + i, len(prompt) + i) for i in range(5)]
        runs.append((steps, state_arrays(runner.sessions()[0].state)))
    (ref_steps, ref_state), (got_steps, got_state) = runs
    for a, b in zip(got_steps, ref_steps, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)
    assert_states_close(got_state, ref_state, 1e-5)
    plain, traced, drafted = greedy_both_paths(install, take, open_runner, prompt[:37])
    assert traced == plain == drafted
