"""qwen4_exp through its hooks: decode, chunked == sequential prefill, reset,
QSA dense below its budget, snapshot/restore, checkpoint rewind, honest nbytes."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import turbospark_qwen4_exp.state
from turbospark.sdk import (
    InvalidInput,
    MropePositions,
    State,
    VisionInjection,
    VisionMap,
    build_synthetic_install,
    family_hooks,
    load_weights,
    read_manifest,
    state_position,
)
from turbospark_qwen4_exp.model import Qwen4ExpConfig

ATOL = 2e-4
PROMPT = [(7 * i * i + 3 * i + 11) % 128 for i in range(40)]
# Synthetic budget: blocks of 4, top 2 blocks, a 4-token window. Position p is
# dense while floor((p + 1 - 4) / 4) <= 2, i.e. for p <= 14; sparse from 15 on.
LAST_DENSE = 14


def _hook() -> Any:
    return family_hooks("qwen4_exp")


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen4_exp")
    build_synthetic_install("qwen4_exp", path, vocab_size=128, model_id="tiny")
    return path


def _load(path: Path, **overrides: Any) -> tuple[Qwen4ExpConfig, nn.Module]:
    manifest = read_manifest(path)
    arch = Qwen4ExpConfig.model_validate({**manifest.arch, **overrides, "family": "qwen4_exp"})
    weights = load_weights(path, manifest)
    return arch, _hook().turbospark_load_model(
        arch=arch, weights=weights, dtype=mx.float32, experts=None
    )


@pytest.fixture(scope="module")
def loaded(install: Path) -> tuple[Qwen4ExpConfig, nn.Module]:
    return _load(install)


def _state(loaded: tuple[Qwen4ExpConfig, nn.Module]) -> State:
    arch, model = loaded
    return _hook().turbospark_new_state(arch=arch, model=model, context_length=4096)


def _forward(model: nn.Module, state: State, tokens: list[int], start: int, logits: str) -> Any:
    return _hook().turbospark_forward(
        model=model, tokens=mx.array(tokens, dtype=mx.int32), start=start, state=state,
        vision=None, logits=logits, steer=None,
    )  # fmt: skip


def _sequential(model: nn.Module, state: State, tokens: list[int], start: int = 0) -> np.ndarray:
    """Token by token; ``(len(tokens), vocab)`` logits."""
    rows = [_forward(model, state, [t], start + i, "last") for i, t in enumerate(tokens)]
    return np.array(mx.stack(rows))


def _chunked(model: nn.Module, state: State, tokens: list[int], chunk: int) -> np.ndarray:
    rows = [
        np.array(_forward(model, state, tokens[s : s + chunk], s, "all"))
        for s in range(0, len(tokens), chunk)
    ]
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def sequential_logits(loaded: tuple[Qwen4ExpConfig, nn.Module]) -> np.ndarray:
    return _sequential(loaded[1], _state(loaded), PROMPT)


def _positions(state: State) -> dict[str, int]:
    return {name: component.position for name, component in state.items()}


def test_declares_five_components_and_only_kv_swappable(loaded: tuple) -> None:
    arch, _ = loaded
    hook = _hook()
    spec = hook.turbospark_family()
    names = [c.name for c in spec.components]
    assert names == ["kv", "gdn", "qsa", "ngram_context", "ple_conv_tail"]
    assert sorted(_state(loaded)) == sorted(names)
    assert hook.turbospark_pool_capability(arch=arch) == ["kv"]
    assert spec.component("gdn").rewindable is False
    assert spec.component("kv").rewindable is True
    assert spec.state_source == inspect.getsourcefile(
        turbospark_qwen4_exp.state
    )  # wherever it is installed
    assert (
        spec.state_source.endswith("turbospark_qwen4_exp/state.py")
        and Path(spec.state_source).is_file()
    )


def test_decode_end_to_end(loaded: tuple) -> None:
    _, model = loaded
    state = _state(loaded)
    logits = _forward(model, state, PROMPT[:10], 0, "last")
    assert logits.shape == (128,) and logits.dtype == mx.float32
    position = 10
    for _ in range(8):
        assert np.isfinite(np.array(logits)).all()
        token = int(mx.argmax(logits).item())
        logits = _forward(model, state, [token], position, "last")
        position += 1
        assert set(_positions(state).values()) == {position}
    assert _forward(model, state, [1, 2], position, "none") is None
    assert state_position(state) == position + 2


def test_all_logits_shape_and_position_check(loaded: tuple) -> None:
    _, model = loaded
    state = _state(loaded)
    assert _forward(model, state, PROMPT[:5], 0, "all").shape == (5, 128)
    with pytest.raises(InvalidInput, match="position 5"):
        _forward(model, state, PROMPT[5:7], 7, "last")


@pytest.mark.parametrize("chunk", [2, 3, 5, 7, 16, 40])
def test_chunked_prefill_equals_sequential(
    loaded: tuple, sequential_logits: np.ndarray, chunk: int
) -> None:
    state = _state(loaded)
    chunked = _chunked(loaded[1], state, PROMPT, chunk)
    np.testing.assert_allclose(chunked, sequential_logits, atol=ATOL, rtol=0)
    assert set(_positions(state).values()) == {len(PROMPT)}


def test_reset_clears_every_component(loaded: tuple, sequential_logits: np.ndarray) -> None:
    _, model = loaded
    state = _state(loaded)
    fresh = {name: component.nbytes for name, component in state.items()}
    _forward(model, state, PROMPT[::-1][:25], 0, "none")
    assert all(state[name].nbytes >= fresh[name] for name in state)
    assert state["kv"].nbytes > fresh["kv"] and state["qsa"].nbytes > fresh["qsa"]
    for component in state.values():
        component.reset()
    assert {name: component.nbytes for name, component in state.items()} == fresh
    assert set(_positions(state).values()) == {0}
    np.testing.assert_allclose(_chunked(model, state, PROMPT, 9), sequential_logits, atol=ATOL)


def test_qsa_is_dense_below_its_budget_and_sparse_above(
    install: Path, loaded: tuple, sequential_logits: np.ndarray
) -> None:
    dense_arch, dense_model = _load(install, qsa_top_blocks=10**6)
    dense = _hook().turbospark_new_state(arch=dense_arch, model=dense_model, context_length=4096)
    # The dense reference through a single chunk: the mask-free causal path.
    dense_logits = np.array(_forward(dense_model, dense, PROMPT, 0, "all"))
    sparse = sequential_logits
    below = slice(0, LAST_DENSE + 1)
    np.testing.assert_allclose(sparse[below], dense_logits[below], atol=ATOL, rtol=0)
    gap = np.abs(sparse - dense_logits).max(axis=-1)
    assert gap[LAST_DENSE + 1 :].max() > 1e-2, gap
    # Chunked sparse prefill also departs from dense at the same place.
    chunked = _chunked(loaded[1], _state(loaded), PROMPT, 40)
    np.testing.assert_allclose(chunked[below], dense_logits[below], atol=ATOL, rtol=0)


def test_snapshot_restore_round_trips(loaded: tuple) -> None:
    _, model = loaded
    state = _state(loaded)
    _forward(model, state, PROMPT[:18], 0, "none")
    snap = {name: component.snapshot() for name, component in state.items()}
    ahead = np.array(_forward(model, state, PROMPT[18:30], 18, "all"))
    for name, component in state.items():
        component.restore(snap[name])
    assert set(_positions(state).values()) == {18}
    np.testing.assert_allclose(np.array(_forward(model, state, PROMPT[18:30], 18, "all")), ahead)
    # A snapshot also moves a session into another, fresh state object.
    other = _state(loaded)
    for name, component in other.items():
        component.restore(snap[name])
    np.testing.assert_allclose(np.array(_forward(model, other, PROMPT[18:30], 18, "all")), ahead)


def test_checkpoint_then_rewind_kv_and_qsa(loaded: tuple) -> None:
    """The generation loop's recovery: restore the non-rewindable components
    from a checkpoint, rewind kv and qsa in place to the same position."""
    _, model = loaded
    state = _state(loaded)
    _forward(model, state, PROMPT[:21], 0, "none")
    spec = _hook().turbospark_family()
    fixed = [c.name for c in spec.components if c.rewindable is False]
    assert fixed == ["gdn", "ngram_context", "ple_conv_tail"]
    checkpoint = {name: state[name].snapshot() for name in fixed}
    _forward(model, state, PROMPT[21:34], 21, "none")
    for name in fixed:
        state[name].restore(checkpoint[name])
    for name in ("kv", "qsa"):
        assert state[name].max_safe_rewind == 34
        state[name].rewind(13)
    tail = [5, 9, 2, 7, 1, 3, 8, 4, 6, 0, 11, 99, 98, 97]
    resumed = np.array(_forward(model, state, tail, 21, "all"))
    fresh = _state(loaded)
    _forward(model, fresh, PROMPT[:21], 0, "none")
    np.testing.assert_allclose(
        resumed, np.array(_forward(model, fresh, tail, 21, "all")), atol=ATOL
    )


def test_nbytes_is_the_sum_of_held_arrays(loaded: tuple) -> None:
    _, model = loaded
    state = _state(loaded)
    for length in (0, 3, 30):
        if length:
            _forward(model, state, PROMPT[:length], state_position(state), "none")
        for name, component in state.items():
            assert component.nbytes == sum(a.nbytes for a in component.arrays()), name
    # kv and qsa grow in 256-row steps: allocated bytes, not just used ones.
    arch, _ = loaded
    index_rows = 256 * arch.index_head_dim * 4
    assert state["qsa"].nbytes == 2 * len(arch.qsa_layers) * index_rows


def test_vision_rows_replace_token_embeddings(loaded: tuple) -> None:
    arch, model = loaded
    rows = mx.array(np.random.default_rng(0).normal(size=(3, arch.hidden_size)), dtype=mx.float32)
    vision = VisionMap.validated(
        [VisionInjection(start=4, embeddings=rows)],
        MropePositions(triples=[(i, i, i) for i in range(10)]),
        prompt_len=10,
        hidden_size=arch.hidden_size,
    )
    plain = np.array(_forward(model, _state(loaded), PROMPT[:10], 0, "all"))
    state = _state(loaded)
    seen = _hook().turbospark_forward(
        model=model, tokens=mx.array(PROMPT[:10]), start=0, state=state, vision=vision,
        logits="all", steer=None,
    )  # fmt: skip
    seen = np.array(seen)
    np.testing.assert_allclose(seen[:4], plain[:4], atol=ATOL)
    assert np.abs(seen[4:] - plain[4:]).max(axis=-1).min() > 1e-3
    assert state_position(state) == 10
