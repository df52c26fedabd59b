"""The qwen4_exp family's hook implementations (entry point ``turbospark:qwen4_exp``)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from turbospark.sdk import (
    ArchConfig,
    CommonHooks,
    InvalidInput,
    LayerHook,
    LogitsWanted,
    State,
    VisionMap,
    batch_logits_for,
    hookimpl,
    load_checked,
    logits_for,
    state_position,
)
from turbospark_qwen4_exp import state as state_module
from turbospark_qwen4_exp import synthetic
from turbospark_qwen4_exp.model import Qwen4Exp, Qwen4ExpConfig, sanitize
from turbospark_qwen4_exp.state import check_batch_positions, new_state

TURBOSPARK_SDK = ">=1.1,<2"  # the turbospark.sdk versions this family is written for

common = CommonHooks(
    "qwen4_exp", ["qwen4_exp"], Qwen4ExpConfig, state_module, synthetic.build, steerable=True
)
turbospark_family = common.turbospark_family
turbospark_pool_capability = common.turbospark_pool_capability
turbospark_build_synthetic_install = common.turbospark_build_synthetic_install


@hookimpl
def turbospark_tool_syntax(chat_template: str | None) -> str:
    # Qwen3.5's templates write <function=NAME> blocks; a Qwen3-style template, JSON ones.
    return "qwen3_xml" if "<function=" in (chat_template or "") else "qwen3_json"


@hookimpl
def turbospark_load_model(
    arch: ArchConfig, weights: dict[str, mx.array], dtype: mx.Dtype
) -> nn.Module:
    assert isinstance(arch, Qwen4ExpConfig)
    return load_checked(Qwen4Exp(arch), sanitize(weights, arch), dtype)


@hookimpl
def turbospark_new_state(arch: ArchConfig, model: nn.Module, context_length: int) -> State:
    assert isinstance(arch, Qwen4ExpConfig)
    return new_state(arch, model.model.embed_ngram.weight.dtype)


@hookimpl
def turbospark_forward_hidden(
    model: nn.Module, tokens: mx.array, start: int, state: State
) -> mx.array:
    return model(tokens[None], [start], state, None)[0]  # (L, hidden)


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
    if state_position(state) != start:
        # The n-gram context and conv tail only continue from where they stopped.
        raise InvalidInput(
            f"qwen4_exp state is at position {state_position(state)}, asked to write at {start}; "
            "rewind or reset the session first"
        )
    hidden = model(tokens[None], [start], state, vision, steer)[0]  # (L, hidden)
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
    check_batch_positions(state, positions)
    hidden = model(tokens, positions, state, None, steer)  # (B, L, hidden)
    return batch_logits_for(hidden, model.head, logits)
