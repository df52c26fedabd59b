"""gemma4 state and loading: window rewind, uniform state shape, vision rows,
refusals of bad installs and bad synthetic dims."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from pydantic import ValidationError

from turbospark.sdk import (
    GEMMA_TEXT,
    InstallError,
    InvalidInput,
    MropePositions,
    RewindError,
    State,
    VisionInjection,
    VisionMap,
    build_synthetic_install,
    family_hooks,
    load_weights,
    peek_manifest_arch,
    read_manifest,
    state_position,
    write_install,
)
from turbospark_gemma4.model import Gemma4Config

WINDOW = 8
ATOL = 1e-4


def _hook() -> Any:
    return family_hooks("gemma4")


def _load(path: Path) -> tuple[Gemma4Config, nn.Module]:
    arch = peek_manifest_arch(path)
    weights = load_weights(path, read_manifest(path))
    return arch, _hook().turbospark_load_model(
        arch=arch, weights=weights, dtype=mx.float32, experts=None
    )


def _feed(model: nn.Module, state: State, tokens: list[int], start: int, **kw: Any) -> np.ndarray:
    out = _hook().turbospark_forward(
        model=model,
        tokens=mx.array(tokens),
        start=start,
        state=state,
        logits="all",
        **{"vision": None, "steer": None, **kw},
    )
    return np.array(out)


def _prefill(model: nn.Module, state: State, prompt: list[int], chunk: int = 100) -> State:
    for start in range(0, len(prompt), chunk):
        _feed(model, state, prompt[start : start + chunk], start)
    return state


@pytest.fixture(scope="module")
def shared_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("g4")
    build_synthetic_install(
        "gemma4", path, num_layers=4, num_experts=4, top_k_experts=2, sliding_window=WINDOW, seed=3
    )
    return path


def test_window_rewind_within_headroom_is_exact(shared_install: Path) -> None:
    arch, model = _load(shared_install)
    rng = np.random.default_rng(0)
    # Chunks that outgrow the KV buffer's first 256-row block, so the ring drops old rows.
    prompt = rng.integers(0, 128, 300).tolist()
    state = _prefill(
        model, _hook().turbospark_new_state(arch=arch, model=model, context_length=512), prompt
    )
    window = state["window"]
    assert WINDOW <= window.max_safe_rewind < len(prompt), "the ring should have dropped rows"
    assert state["kv"].max_safe_rewind == len(prompt)

    back = window.max_safe_rewind
    keep = len(prompt) - back
    for component in state.values():
        component.rewind(back)
    assert state_position(state) == keep
    tail = rng.integers(0, 128, back + 3).tolist()
    rewound = _feed(model, state, tail, keep)

    fresh = _hook().turbospark_new_state(arch=arch, model=model, context_length=512)
    _feed(model, fresh, prompt[:keep], 0)
    np.testing.assert_allclose(rewound, _feed(model, fresh, tail, keep), atol=ATOL)


def test_window_rewind_past_headroom_is_refused(shared_install: Path) -> None:
    arch, model = _load(shared_install)
    prompt = np.random.default_rng(1).integers(0, 128, 300).tolist()
    state = _prefill(
        model, _hook().turbospark_new_state(arch=arch, model=model, context_length=512), prompt
    )
    window = state["window"]
    limit = window.max_safe_rewind
    with pytest.raises(RewindError, match="window"):
        window.rewind(limit + 1)
    assert window.position == 300 and window.max_safe_rewind == limit


def test_both_components_exist_without_layers_of_a_kind(tmp_path: Path) -> None:
    """One sliding layer: ``kv`` has no layer but still advances with the rest."""
    build_synthetic_install("gemma4", tmp_path, num_layers=1, sliding_window=WINDOW)
    arch, model = _load(tmp_path)
    state = _hook().turbospark_new_state(arch=arch, model=model, context_length=64)
    assert set(state) == {"kv", "window"} and state["kv"].layers == []
    _feed(model, state, [5, 6, 7], 0)
    assert state_position(state) == 3


def test_vision_rows_replace_token_embeddings(tmp_path: Path) -> None:
    """Without PLE, injecting token B's embedding row at a position equals feeding B there."""
    build_synthetic_install("gemma4", tmp_path, num_layers=2, hidden_size_per_layer_input=0)
    arch, model = _load(tmp_path)
    prompt, image = [1, 9, 9, 9, 4, 5], [40, 41, 42]
    rows = model.model.embed_tokens.weight[mx.array(image)]  # (3, hidden)
    vision = VisionMap.validated(
        [VisionInjection(start=1, embeddings=rows)],
        MropePositions(triples=[(i, i, i) for i in range(len(prompt))]),
        prompt_len=len(prompt),
        hidden_size=arch.hidden_size,
    )
    hook = _hook()
    with_vision = hook.turbospark_new_state(arch=arch, model=model, context_length=64)
    got = [
        _feed(model, with_vision, prompt[:3], 0, vision=vision),
        _feed(model, with_vision, prompt[3:], 3, vision=vision),
    ]
    plain = hook.turbospark_new_state(arch=arch, model=model, context_length=64)
    expected = _feed(model, plain, [1, *image, 4, 5], 0)
    np.testing.assert_allclose(np.concatenate(got), expected, atol=ATOL)


def _rewrite(src: Path, dst: Path, edit: Any) -> None:
    """A consistent install at *dst* whose safetensors are *src*'s after *edit*."""
    manifest = read_manifest(src)
    weights = load_weights(src, manifest)
    edit(weights)
    arch = peek_manifest_arch(src)
    write_install(
        dst,
        arch=arch,
        model_id="edited",
        weights=weights,
        extra_files=GEMMA_TEXT.files(arch.vocab_size),
    )


def test_missing_tensor_is_named(shared_install: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.q_proj.weight"
    _rewrite(shared_install, tmp_path, lambda w: w.pop(name))
    with pytest.raises(InstallError, match=f"missing tensor.*{name}"):
        _load(tmp_path)


def test_misshaped_tensor_is_named(shared_install: Path, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.k_norm.weight"

    def edit(weights: dict[str, mx.array]) -> None:
        weights[name] = mx.ones((weights[name].shape[0] + 2,))

    _rewrite(shared_install, tmp_path, edit)
    with pytest.raises(InstallError, match=name):
        _load(tmp_path)


def test_unknown_synthetic_dim_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="num_lyers"):
        build_synthetic_install("gemma4", tmp_path, num_lyers=4)
    assert not (tmp_path / "manifest.json").exists()


def test_shared_layer_needs_an_owner_of_its_type() -> None:
    with pytest.raises(ValidationError, match="no earlier layer of that type"):
        Gemma4Config(
            family="gemma4",
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            num_kv_shared_layers=1,
        )
