"""QSA against a brute-force reference, and the plugin's own state components."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark.sdk import RewindError
from turbospark_qwen4_exp.qsa import QSABudget, qsa_attention
from turbospark_qwen4_exp.state import LayerIndex, QSAComponent, StreamTail

BUDGET = QSABudget(block_size=4, top_blocks=2, local_window=5)
HEADS, KV_HEADS, DIM, INDEX_DIM = 4, 2, 8, 6
TOKENS = 37


def _visible(p: int, index_q: np.ndarray, index_keys: np.ndarray) -> set[int]:
    """The rule as the README states it, one query at a time."""
    size, top, window = BUDGET.block_size, BUDGET.top_blocks, BUDGET.local_window
    local = max(0, (p + 1 - window) // size * size)
    pooled = [index_keys[j * size : (j + 1) * size].mean(axis=0) for j in range(local // size)]
    scores = [float(index_q @ block) for block in pooled]
    chosen = sorted(range(len(scores)), key=lambda j: -scores[j])[:top]
    return {t for j in chosen for t in range(j * size, (j + 1) * size)} | set(range(local, p + 1))


def _reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, iq: np.ndarray, ik: np.ndarray, start: int
) -> np.ndarray:
    """``(1, heads, L, dim)`` softmax attention over each query's visible keys."""
    out = np.zeros_like(q)
    group = HEADS // KV_HEADS
    for i in range(q.shape[2]):
        keep = sorted(_visible(start + i, iq[i], ik))
        for h in range(HEADS):
            logits = k[0, h // group, keep] @ q[0, h, i] * DIM**-0.5
            weights = np.exp(logits - logits.max())
            out[0, h, i] = weights @ v[0, h // group, keep] / weights.sum()
    return out


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "q": rng.normal(size=(1, HEADS, TOKENS, DIM)).astype(np.float32),
        "k": rng.normal(size=(1, KV_HEADS, TOKENS, DIM)).astype(np.float32),
        "v": rng.normal(size=(1, KV_HEADS, TOKENS, DIM)).astype(np.float32),
        "iq": rng.normal(size=(TOKENS, INDEX_DIM)).astype(np.float32),
        "ik": rng.normal(size=(TOKENS, INDEX_DIM)).astype(np.float32),
    }


def _run(x: dict[str, np.ndarray], start: int, stop: int) -> np.ndarray:
    """qsa_attention for queries ``start..stop-1`` with the index built by LayerIndex."""
    index = LayerIndex(BUDGET.block_size)
    if start:
        index.append(mx.array(x["ik"][:start]))
    pooled = index.append(mx.array(x["ik"][start:stop]))
    out = qsa_attention(
        mx.array(x["q"][:, :, start:stop]), mx.array(x["k"][:, :, :stop]),
        mx.array(x["v"][:, :, :stop]), mx.array(x["iq"][start:stop]), pooled, start, BUDGET,
        DIM**-0.5,
    )  # fmt: skip
    return np.array(out)


@pytest.mark.parametrize(("start", "stop"), [(0, TOKENS), (0, 13), (9, 30), (22, TOKENS)])
def test_prefill_matches_brute_force(inputs: dict[str, np.ndarray], start: int, stop: int) -> None:
    x = inputs
    expected = _reference(
        x["q"][:, :, start:stop], x["k"][:, :, :stop], x["v"][:, :, :stop],
        x["iq"][start:stop], x["ik"][:stop], start,
    )  # fmt: skip
    np.testing.assert_allclose(_run(x, start, stop), expected, atol=1e-5)


@pytest.mark.parametrize("position", [0, 5, 13, 14, 15, 19, 28, TOKENS - 1])
def test_decode_matches_brute_force(inputs: dict[str, np.ndarray], position: int) -> None:
    x = inputs
    expected = _reference(
        x["q"][:, :, position : position + 1], x["k"][:, :, : position + 1],
        x["v"][:, :, : position + 1], x["iq"][position : position + 1], x["ik"][: position + 1],
        position,
    )  # fmt: skip
    np.testing.assert_allclose(_run(x, position, position + 1), expected, atol=1e-5)


def test_budget_boundaries() -> None:
    # Dense while p + 1 <= top * size + window (= 13) and until the window's
    # start crosses the next block boundary; sparse from then on.
    assert [BUDGET.is_dense(p) for p in range(12, 18)] == [True, True, True, True, False, False]
    assert len(_visible(30, np.ones(INDEX_DIM), np.ones((31, INDEX_DIM)))) < 31
    assert QSABudget(4, 2, 4).is_dense(14) and not QSABudget(4, 2, 4).is_dense(15)


def test_layer_index_pools_complete_blocks_and_rewinds() -> None:
    keys = mx.arange(30 * 2, dtype=mx.float32).reshape(30, 2)
    index = LayerIndex(4)
    assert index.append(keys[:3]).shape == (0, 2)
    pooled = index.append(keys[3:10])
    np.testing.assert_array_equal(
        np.array(pooled), np.array(keys[:8].reshape(2, 4, 2).mean(axis=1))
    )
    index.rewind(3)  # position 7: block 1 is no longer complete
    assert index.blocks == 1
    changed = mx.full((5, 2), 100.0)
    pooled = index.append(changed)  # tokens 7..11: blocks 1 and 2 complete again
    expected = mx.concatenate([keys[:7], changed]).reshape(3, 4, 2).mean(axis=1)
    np.testing.assert_array_equal(np.array(pooled), np.array(expected))


def test_qsa_component_refuses_rewind_past_its_start() -> None:
    component = QSAComponent(num_layers=2, block_size=4)
    for layer in component.layers:
        layer.append(mx.zeros((6, 3)))
    component.advance(6)
    with pytest.raises(RewindError, match="'qsa' can rewind at most 6"):
        component.rewind(7)
    component.rewind(6)
    assert component.position == 0 and all(layer.fill == 0 for layer in component.layers)


def test_stream_tail_keeps_its_window_and_cannot_rewind() -> None:
    tail = StreamTail("ngram_context", mx.full((2,), 2, dtype=mx.int32))
    window = tail.push(mx.array([[10, 11, 12]], dtype=mx.int32))[0]
    assert window.tolist() == [2, 2, 10, 11, 12] and tail.tail.tolist() == [11, 12]
    assert tail.push(mx.array([[13]], dtype=mx.int32))[0].tolist() == [11, 12, 13]
    assert tail.position == 4 and tail.max_safe_rewind == 0
    tail.rewind(0)
    with pytest.raises(RewindError, match="'ngram_context' can rewind at most 0"):
        tail.rewind(1)
    snap = tail.snapshot()
    tail.reset()
    assert tail.tail.tolist() == [2, 2] and tail.position == 0
    tail.restore(snap)
    assert tail.tail.tolist() == [12, 13] and tail.position == 4
