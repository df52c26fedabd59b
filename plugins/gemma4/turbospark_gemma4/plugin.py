"""The gemma4 family's hook implementations (entry point ``turbospark:gemma4``)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from turbospark.sdk import (
    ArchConfig,
    CommonHooks,
    ExpertStreams,
    LayerHook,
    LogitsWanted,
    MoESpec,
    State,
    VisionMap,
    batch_logits_for,
    hookimpl,
    load_checked,
    logits_for,
)
from turbospark_gemma4 import state as state_module
from turbospark_gemma4 import synthetic
from turbospark_gemma4.model import Gemma4, Gemma4Config, moe_spec, sanitize
from turbospark_gemma4.state import new_state

TURBOSPARK_SDK = ">=1.2,<2"  # the turbospark.sdk versions this family is written for

common = CommonHooks(
    "gemma4",
    ["gemma4_text"],
    Gemma4Config,
    state_module,
    synthetic.build,
    steerable=True,
    kv_quantizable=True,
)
turbospark_family = common.turbospark_family
turbospark_pool_capability = common.turbospark_pool_capability
turbospark_build_synthetic_install = common.turbospark_build_synthetic_install


@hookimpl
def turbospark_moe(arch: ArchConfig) -> MoESpec | None:
    assert isinstance(arch, Gemma4Config)
    return moe_spec(arch)


@hookimpl
def turbospark_tool_syntax(chat_template: str | None) -> str:
    return "gemma4"  # <|tool_call>call:NAME{...}<tool_call|>, every Gemma 4 template


@hookimpl
def turbospark_load_model(
    arch: ArchConfig, weights: dict[str, mx.array], dtype: mx.Dtype, experts: ExpertStreams | None
) -> nn.Module:
    assert isinstance(arch, Gemma4Config)
    model = Gemma4(arch)
    if experts is not None:  # streamed: the experts are not among the weights
        experts.attach(model)
    return load_checked(model, sanitize(weights, arch), dtype)


@hookimpl
def turbospark_quantize_overrides(arch: ArchConfig) -> dict[str, dict[str, int] | bool]:
    # mlx-lm's gemma4 quant_predicate: the MoE router stays at 8 bits in groups of 64.
    return {"router.proj": {"group_size": 64, "bits": 8}}


@hookimpl
def turbospark_shard_model(model: nn.Module, group: mx.distributed.Group) -> bool:
    assert isinstance(model, Gemma4)
    model.shard(group)
    return True


@hookimpl
def turbospark_new_state(arch: ArchConfig, model: nn.Module, context_length: int) -> State:
    assert isinstance(arch, Gemma4Config)
    return new_state(arch)


@hookimpl
def turbospark_forward_hidden(
    model: nn.Module, tokens: mx.array, start: int, state: State
) -> mx.array:
    return model(tokens[None], start, state, None).squeeze(0)  # (L, hidden)


# Rows by squeeze(0), a view: x[0] is a gather, one kernel more per step.
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
    # Only "all" reads every row; otherwise the KV-shared tail runs for the last one.
    # (L, hidden)
    hidden = model(tokens[None], start, state, vision, logits != "all", steer).squeeze(0)
    return logits_for(hidden, model.head, logits)


@hookimpl
def turbospark_forward_batch(
    model: nn.Module,
    tokens: mx.array,
    positions: list[int],
    state: State,
    logits: LogitsWanted,
    steer: LayerHook | None,
) -> mx.array | None:
    hidden = model(tokens, mx.array(positions), state, None, logits != "all", steer)
    return batch_logits_for(hidden, model.head, logits)
