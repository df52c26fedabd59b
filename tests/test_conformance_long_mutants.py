"""The kit catches faults that only show at length, or only on a shared model.

Two mutants of the real gemma4 family (``mutant_families.py``), each planting a
bug a family author wrote from the docs and the old kit let through:

- a K/V buffer that loses a row when a full 256-row block is regrown (the old
  kit's 16-token prompts never regrow a block);
- per-layer K/V kept on the model object, so every "fresh" state shares it
  (the old kit compared only the top-level component objects, and blamed
  ``reset()`` for the dirt a fresh state carried).

Each named check must fail with a message that names the place; the
unmutated wrapper passes the same checks, so the failures are the fault's.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import pytest

from turbospark.conformance import FamilyConformance, FamilyKit
from turbospark.state.components import LayeredComponent, State
from turbospark.state.kv import KVComponent, LayerKV


class DropsRowOnRegrow(LayerKV):
    """Grows like :class:`LayerKV`, but regrowing a full buffer copies it one row
    short: its last row is zeros afterwards."""

    def _make_room(self, keys: mx.array, values: mx.array, length: int) -> None:
        full = self.keys is not None and self.fill == self.keys.shape[2]
        super()._make_room(keys, values, length)
        if full:
            self.keys[:, :, self.fill - 1] = 0
            self.values[:, :, self.fill - 1] = 0


def drop_row_on_regrow(state: State, model: nn.Module) -> State:
    kv = state["kv"]
    assert isinstance(kv, LayeredComponent)
    layers = [DropsRowOnRegrow() for _ in kv.layers]
    return {**state, "kv": KVComponent.adopt("kv", layers, None, 0, 0)}


class KVOnTheModel:
    """Keeps each model's per-layer K/V in one list that every new state's
    ``kv`` component wraps: the component objects differ, their layers do not."""

    def __init__(self) -> None:
        self.layers: dict[int, list[LayerKV]] = {}

    def __call__(self, state: State, model: nn.Module) -> State:
        kv = state["kv"]
        assert isinstance(kv, LayeredComponent)
        layers = self.layers.setdefault(id(model), kv.layers)
        return {**state, "kv": KVComponent.adopt("kv", layers, None, 0, 0)}


CHECKS = FamilyConformance()

# (check, arguments, pattern its failure message must match)
DROPPED_ROW_FAILURES = [
    (
        CHECKS.test_long_prompt_chunked_equals_one_chunk,
        (),
        r"600-token prompt, uneven chunks \(250, 6, 1, 50, .*\): logits first differ from one "
        r"fresh chunk at position 25[6-9] \(in the chunk 25[67]\.\.\d+\).* component 'kv' entry "
        r"'0\.keys' differs from a fresh run by up to \S+ first at index \(0, \d+, 255, \d+\)",
    ),
    (
        CHECKS.test_long_rewind_across_a_block_boundary,
        ("kv",),
        r"'kv' rewound by 95 from 600 to 505, then 13 and 27 other tokens: logits first differ "
        r"from one fresh chunk at position 505 .* at 545: component 'kv' entry '0\.keys' differs "
        r"from a fresh run by up to \S+ first at index \(0, \d+, 255, \d+\); component 'kv' entry "
        r"'0\.values' differs [^;]*$",
    ),
]
SHARED_MODEL_FAILURES = [
    (
        CHECKS.test_state_matches_declaration,
        (),
        r"component 'kv' of another fresh state holds state\['kv'\]\.layers \(list\), the same "
        r"object as one fresh state's state\['kv'\]\.layers",
    ),
    (
        CHECKS.test_nbytes_honest,
        ("kv",),
        r"a new state built after another took 32 tokens has component 'kv' at position 0 "
        r"holding \d+ bytes .* turbospark_new_state hands out state another session writes",
    ),
]


def expect_failure(kit: FamilyKit, check: Callable[..., None], args: tuple, pattern: str) -> None:
    with pytest.raises(AssertionError) as failure:
        check(kit, *args)
    assert re.search(pattern, str(failure.value)), str(failure.value)


@pytest.mark.parametrize("mutant_kit", [("gemma4_drops_row", drop_row_on_regrow)], indirect=True)
@pytest.mark.parametrize("check, args, pattern", DROPPED_ROW_FAILURES)
def test_row_dropped_on_regrow_is_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    expect_failure(mutant_kit, check, args, pattern)


@pytest.mark.parametrize("mutant_kit", [("gemma4_kv_on_model", KVOnTheModel())], indirect=True)
@pytest.mark.parametrize("check, args, pattern", SHARED_MODEL_FAILURES)
def test_kv_on_the_model_is_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    expect_failure(mutant_kit, check, args, pattern)


@pytest.mark.parametrize("mutant_kit", [("gemma4_plain", None)], indirect=True)
@pytest.mark.parametrize("check, args, pattern", DROPPED_ROW_FAILURES + SHARED_MODEL_FAILURES)
def test_the_wrapper_alone_passes(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    check(mutant_kit, *args)
