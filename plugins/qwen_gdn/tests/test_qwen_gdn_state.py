"""The ``gdn`` state component through the family's hooks: refusal to rewind,
snapshot/restore, honest ``nbytes``, and reset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from turbospark.sdk import (
    GDNComponent,
    GDNDims,
    RewindError,
    State,
    StateComponent,
    build_synthetic_install,
    family_hooks,
    load_weights,
    read_manifest,
)

PROMPT = np.random.default_rng(2).integers(0, 128, 50).tolist()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    path: Path = tmp_path_factory.mktemp("qwen_gdn_state")
    arch = build_synthetic_install("qwen_gdn", path, vocab_size=128, model_id="tiny", seed=4)
    hook = family_hooks("qwen_gdn")
    weights = load_weights(path, read_manifest(path))
    model = hook.turbospark_load_model(arch=arch, weights=weights, dtype=mx.float32, experts=None)
    return hook, arch, model


def _fresh(loaded: tuple[Any, Any, Any]) -> State:
    hook, arch, model = loaded
    return hook.turbospark_new_state(arch=arch, model=model, context_length=256)


def _feed(loaded: tuple[Any, Any, Any], state: State, tokens: list[int], start: int) -> np.ndarray:
    hook, _, model = loaded
    out = hook.turbospark_forward(
        model=model,
        tokens=mx.array(tokens),
        start=start,
        state=state,
        vision=None,
        logits="all",
        steer=None,
    )
    return np.array(out)


def test_components_follow_the_protocol(loaded: tuple[Any, Any, Any]) -> None:
    state = _fresh(loaded)
    assert set(state) == {"kv", "gdn"}
    assert all(isinstance(c, StateComponent) for c in state.values())
    assert isinstance(state["gdn"], GDNComponent)


def test_rewind_is_refused_and_harmless(loaded: tuple[Any, Any, Any]) -> None:
    state = _fresh(loaded)
    _feed(loaded, state, PROMPT[:20], 0)
    gdn = state["gdn"]
    assert gdn.max_safe_rewind == 0
    before = gdn.snapshot()
    with pytest.raises(RewindError, match="'gdn'"):
        gdn.rewind(3)
    gdn.rewind(0)
    assert gdn.position == 20
    after = gdn.snapshot()
    assert before.keys() == after.keys() and all(
        before[k] is after[k] for k in before if k != "position"
    )


def test_snapshot_restore_round_trip(loaded: tuple[Any, Any, Any]) -> None:
    state = _fresh(loaded)
    _feed(loaded, state, PROMPT[:30], 0)
    snap = {name: c.snapshot() for name, c in state.items()}
    # Held references, not copies: the live arrays are the snapshot's arrays.
    tail, recurrent = state["gdn"].layer(0)
    assert snap["gdn"]["0.conv_tail"] is tail and snap["gdn"]["0.recurrent"] is recurrent
    first = _feed(loaded, state, PROMPT[30:], 30)
    assert state["gdn"].layer(0)[1] is not recurrent  # replaced, never mutated in place
    for name, component in state.items():
        component.restore(snap[name])
    assert {c.position for c in state.values()} == {30}
    np.testing.assert_array_equal(_feed(loaded, state, PROMPT[30:], 30), first)


def test_nbytes_is_the_arrays_held(loaded: tuple[Any, Any, Any]) -> None:
    _, arch, _ = loaded
    state = _fresh(loaded)
    gdn = state["gdn"]
    assert gdn.nbytes == 0 and gdn.arrays() == []
    _feed(loaded, state, PROMPT[:9], 0)
    d = GDNDims.of(arch)
    conv_tail = (d.conv_kernel - 1) * d.conv_dim * 4  # float32 bytes
    recurrent = d.num_value_heads * d.value_head_dim * d.key_head_dim * 4
    linear = sum(arch.is_linear(i) for i in range(arch.num_hidden_layers))
    assert gdn.nbytes == sum(a.nbytes for a in gdn.arrays()) == linear * (conv_tail + recurrent)


def test_reset_gives_a_fresh_session(loaded: tuple[Any, Any, Any]) -> None:
    expected = _feed(loaded, _fresh(loaded), PROMPT[:12], 0)
    state = _fresh(loaded)
    _feed(loaded, state, PROMPT[20:45], 0)
    for component in state.values():
        component.reset()
    assert {c.position for c in state.values()} == {0} and state["gdn"].nbytes == 0
    np.testing.assert_array_equal(_feed(loaded, state, PROMPT[:12], 0), expected)
