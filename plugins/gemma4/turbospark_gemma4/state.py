"""Gemma 4's per-session state: attention K/V, split by layer kind.

- ``kv``: one :class:`~turbospark.state.kv.LayerKV` per full-attention layer that
  owns K/V. It keeps every token, so it rewinds without limit.
- ``window``: one windowed ``LayerKV`` per sliding-attention layer that owns
  K/V. It keeps ``sliding_window - 1 + headroom`` recent tokens, so an in-place
  rewind is exact only up to ``headroom`` tokens once the ring has dropped rows.

KV-shared layers have no entry: they attend over their source layer's K/V.
Both components always exist (possibly over zero layers), so every Gemma 4
state has the same shape and advances together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from turbospark.sdk import ComponentSpec, KVComponent, State

if TYPE_CHECKING:
    from turbospark_gemma4.model import Gemma4Config

COMPONENTS = [
    ComponentSpec.of(
        KVComponent.CAPABILITIES, "kv", "keys/values of the full-attention layers that own K/V"
    ),
    ComponentSpec.of(
        KVComponent.WINDOWED,
        "window",
        "sliding-window ring of keys/values of the sliding layers that own K/V",
    ),
]


def kv_slots(arch: Gemma4Config) -> dict[int, tuple[str, int]]:
    """Layer index -> (component, index in it) for every layer that owns K/V."""
    slots: dict[int, tuple[str, int]] = {}
    counts = {"kv": 0, "window": 0}
    for layer in range(arch.first_kv_shared_layer):
        name = "kv" if arch.is_full(layer) else "window"
        slots[layer] = (name, counts[name])
        counts[name] += 1
    return slots


def new_state(arch: Gemma4Config, headroom: int | None = None) -> State:
    """A fresh state; *headroom* defaults to one window, so a rewind of up to
    ``sliding_window`` tokens is always exact."""
    slots = kv_slots(arch).values()
    full = sum(1 for name, _ in slots if name == "kv")
    return {
        "kv": KVComponent(full),
        "window": KVComponent(
            len(slots) - full,
            window=arch.sliding_window,
            headroom=arch.sliding_window if headroom is None else headroom,
        ),
    }
