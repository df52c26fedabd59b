"""The shared KV components against a reference that keeps every row.

Random schedules of appends (any chunk size, crossing the 256-row growth step
and the window's trimming) and rewinds (within ``max_safe_rewind``) must give
the same attention output as exact causal / sliding-window attention over the
full history.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark.errors import RewindError
from turbospark.layers.attention import cached_attention
from turbospark.state.kv import KVComponent

HEADS, DIM = 2, 4


def reference(q: mx.array, keys: np.ndarray, values: np.ndarray, start: int, window: int | None):
    """Exact attention of queries at ``start..`` over the full history (numpy, float64)."""
    out = []
    qn = np.array(q[0], dtype=np.float64)  # (heads, L, dim)
    for i in range(qn.shape[1]):
        pos = start + i
        lo = 0 if window is None else max(0, pos - window + 1)
        k, v = keys[:, lo : pos + 1], values[:, lo : pos + 1]
        scores = np.einsum("hd,hkd->hk", qn[:, i], k) / np.sqrt(DIM)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out.append(np.einsum("hk,hkd->hd", weights, v))
    return np.stack(out, axis=1)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 300)),
        st.tuples(st.just("rewind"), st.integers(1, 40)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=25, deadline=None)
@given(ops=ops, window=st.sampled_from([None, 8, 33]), seed=st.integers(0, 2**16))
def test_kv_component_matches_exact_attention(ops, window, seed):
    rng = np.random.default_rng(seed)
    component = KVComponent(1, window=window, headroom=16 if window else 0)
    history_k = np.zeros((HEADS, 0, DIM))
    history_v = np.zeros((HEADS, 0, DIM))
    for op, n in ops:
        if op == "rewind":
            n = min(n, component.max_safe_rewind)
            component.rewind(n)
            history_k, history_v = (
                history_k[:, : history_k.shape[1] - n],
                history_v[:, : history_v.shape[1] - n],
            )
            continue
        q, k, v = (rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32) for _ in range(3))
        start = component.position
        out, _ = cached_attention(mx.array(q), mx.array(k), mx.array(v), component[0], DIM**-0.5)
        component.advance(n)
        history_k = np.concatenate([history_k, k[0]], axis=1)
        history_v = np.concatenate([history_v, v[0]], axis=1)
        expected = reference(mx.array(q), history_k, history_v, start, window)
        np.testing.assert_allclose(np.array(out[0]), expected, atol=1e-4)
    assert component.position == history_k.shape[1]


def test_window_rewind_past_headroom_is_refused():
    component = KVComponent(1, window=8, headroom=4)
    for _ in range(3):  # 3 x 200 rows: the ring trims, so headroom is what is left
        kv = mx.zeros((1, HEADS, 200, DIM))
        component[0].update_and_fetch(kv, kv)
        component.advance(200)
    limit = component.max_safe_rewind
    assert 4 <= limit < 600
    with pytest.raises(RewindError, match=f"at most {limit}"):
        component.rewind(limit + 1)
    assert component.position == 600


def test_nbytes_counts_allocated_buffers_and_reset_frees_them():
    component = KVComponent(2)
    assert component.nbytes == 0
    for layer in component.layers:
        kv = mx.zeros((1, HEADS, 10, DIM))
        layer.update_and_fetch(kv, kv)
    component.advance(10)
    assert (
        component.nbytes
        == sum(a.nbytes for a in component.arrays())
        == 2 * 2 * HEADS * 256 * DIM * 4
    )
    component.reset()
    assert component.nbytes == 0 and component.position == 0


def test_snapshot_restore_round_trip():
    component = KVComponent(1, window=8, headroom=8)
    kv = mx.arange(HEADS * 30 * DIM, dtype=mx.float32).reshape(1, HEADS, 30, DIM)
    component[0].update_and_fetch(kv, kv)
    component.advance(30)
    snap = component.snapshot()
    component.reset()
    component.restore(snap)
    assert component.position == 30
    q = mx.ones((1, HEADS, 1, DIM))
    restored, _ = cached_attention(q, kv[:, :, :1], kv[:, :, :1], component[0], 1.0)
    fresh = KVComponent(1, window=8, headroom=8)
    fresh[0].update_and_fetch(kv, kv)
    expected, _ = cached_attention(q, kv[:, :, :1], kv[:, :, :1], fresh[0], 1.0)
    assert mx.array_equal(restored, expected)
