"""tinyllama's hook implementations: the whole contract with turbospark.

The entry point ``turbospark:tinyllama`` in ``pyproject.toml`` names this
module; turbospark registers it in a plugin manager of its own and calls the
hooks below (see ``turbospark.contract.hookspecs`` for what each must do). The three
that every family writes alike (declare the family, which components a pool
may park, build a synthetic install) come from :class:`turbospark.loading.family_hooks.CommonHooks`,
derived from what this package declares; the rest are tinyllama's own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from turbospark.sdk import (
    ArchConfig,
    CommonHooks,
    InvalidInput,
    KVComponent,
    LayerHook,
    LogitsWanted,
    State,
    VisionMap,
    hookimpl,
    load_checked,
    logits_for,
)
from turbospark_tinyllama import state as state_module
from turbospark_tinyllama import synthetic
from turbospark_tinyllama.model import Llama, LlamaConfig, sanitize
from turbospark_tinyllama.state import new_state

TURBOSPARK_SDK = ">=1.1,<2"  # the turbospark.sdk versions this family is written for

NAME = "tinyllama"

# steerable: the forward below calls `steer` at every layer's output (opting in).
common = CommonHooks(NAME, ["llama"], LlamaConfig, state_module, synthetic.build, steerable=True)
turbospark_family = common.turbospark_family
turbospark_pool_capability = common.turbospark_pool_capability
turbospark_build_synthetic_install = common.turbospark_build_synthetic_install


@hookimpl
def turbospark_load_model(
    arch: ArchConfig, weights: dict[str, mx.array], dtype: mx.Dtype
) -> nn.Module:
    if not isinstance(arch, LlamaConfig):
        raise InvalidInput(f"tinyllama cannot load a {type(arch).__name__}")
    return load_checked(Llama(arch), sanitize(weights, arch), dtype)


@hookimpl
def turbospark_new_state(arch: ArchConfig, model: nn.Module, context_length: int) -> State:
    return new_state(arch.num_hidden_layers)


@hookimpl
def turbospark_forward(
    model: nn.Module,
    tokens: mx.array,
    start: int,
    state: State,
    vision: VisionMap | None,
    logits: LogitsWanted,
    steer: LayerHook | None,
) -> mx.array | None:
    kv = state["kv"]
    assert isinstance(kv, KVComponent)
    hidden = model(tokens, start, kv, vision, steer)  # (L, hidden)
    # The head runs only where logits are read; the runner evaluates state arrays.
    return logits_for(hidden, model.head, logits)
