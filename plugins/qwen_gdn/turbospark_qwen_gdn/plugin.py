"""The qwen_gdn family's hook implementations (entry point ``turbospark:qwen_gdn``)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from turbospark.sdk import (
    ArchConfig,
    CommonHooks,
    LayerHook,
    LogitsWanted,
    State,
    VisionMap,
    batch_logits_for,
    hookimpl,
    load_checked,
    logits_for,
)
from turbospark_qwen_gdn import state as state_module
from turbospark_qwen_gdn import synthetic
from turbospark_qwen_gdn.model import QwenGdn, QwenGdnConfig, sanitize
from turbospark_qwen_gdn.mtp import QwenMtp
from turbospark_qwen_gdn.state import new_state

TURBOSPARK_SDK = ">=1.2,<2"  # the turbospark.sdk versions this family is written for

# Checkpoints (and mlx-lm) use "qwen3_5"; transformers writes "qwen3_5_text" too.
common = CommonHooks(
    "qwen_gdn",
    ["qwen3_5", "qwen3_5_text"],
    QwenGdnConfig,
    state_module,
    synthetic.build,
    steerable=True,
    kv_quantizable=True,
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
    assert isinstance(arch, QwenGdnConfig)
    clean = sanitize(weights, arch)
    mtp = any(name.startswith("mtp.") for name in clean)  # the head, where the checkpoint has it
    return load_checked(QwenGdn(arch, mtp=mtp), clean, dtype)


@hookimpl
def turbospark_mtp_head(model: nn.Module) -> QwenMtp | None:
    assert isinstance(model, QwenGdn)
    return QwenMtp(model) if "mtp" in model else None


@hookimpl
def turbospark_shard_model(model: nn.Module, group: mx.distributed.Group) -> bool:
    assert isinstance(model, QwenGdn)
    model.shard(group)
    return True


@hookimpl
def turbospark_new_state(arch: ArchConfig, model: nn.Module, context_length: int) -> State:
    assert isinstance(arch, QwenGdnConfig)
    return new_state(arch)


@hookimpl
def turbospark_forward_hidden(
    model: nn.Module, tokens: mx.array, start: int, state: State
) -> mx.array:
    return model(tokens[None], start, state).squeeze(0)  # (L, hidden)


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
    hidden = model(tokens[None], start, state, vision, steer).squeeze(0)  # (L, hidden)
    return logits_for(hidden, model.head, logits)


@hookimpl
def turbospark_forward_with_hidden(
    model: nn.Module,
    tokens: mx.array,
    start: int,
    state: State,
    vision: VisionMap | None,
    logits: LogitsWanted,
    steer: LayerHook | None,
) -> tuple[mx.array | None, mx.array]:
    # (L, hidden), final-normed
    hidden = model(tokens[None], start, state, vision, steer).squeeze(0)
    return logits_for(hidden, model.head, logits), hidden


@hookimpl
def turbospark_forward_batch(
    model: nn.Module,
    tokens: mx.array,
    positions: list[int],
    state: State,
    logits: LogitsWanted,
    steer: LayerHook | None,
) -> mx.array | None:
    hidden = model(tokens, mx.array(positions), state, None, steer)  # (B, L, hidden)
    return batch_logits_for(hidden, model.head, logits)
