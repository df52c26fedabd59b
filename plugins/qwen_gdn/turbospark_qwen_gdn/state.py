"""Qwen3.5's per-session state: attention K/V plus the gated-DeltaNet state.

- ``kv``: one :class:`~turbospark.state.kv.LayerKV` per full-attention layer; it
  keeps every token, so it rewinds without limit.
- ``gdn``: per linear layer, the conv tail and the float32 recurrent matrix
  (:class:`~turbospark.layers.gated_delta.state.GDNComponent`). It can be parked and
  snapshotted, but not rewound: the recurrence cannot be run backwards. A
  speculative verify pass traces it instead (its state after every token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from turbospark.sdk import ComponentSpec, GDNComponent, KVComponent, State

if TYPE_CHECKING:
    from turbospark_qwen_gdn.model import QwenGdnConfig

COMPONENTS = [
    ComponentSpec.of(KVComponent.CAPABILITIES, "kv", "keys/values of the full-attention layers"),
    ComponentSpec.of(
        GDNComponent.CAPABILITIES,
        "gdn",
        "conv tail and float32 recurrent matrix of each gated-DeltaNet layer",
    ),
]


def new_state(arch: QwenGdnConfig) -> State:
    linear = sum(arch.is_linear(i) for i in range(arch.num_hidden_layers))
    return {
        "kv": KVComponent(arch.num_hidden_layers - linear),
        "gdn": GDNComponent(linear),
    }
