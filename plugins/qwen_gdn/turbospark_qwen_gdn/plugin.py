"""The qwen_gdn family's hook implementations (entry point ``turbospark:qwen_gdn``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from turbospark.hookspecs import ArchConfig, FamilySpec, LogitsWanted, hookimpl
from turbospark.install import load_checked
from turbospark.layers.logits import batch_logits_for, logits_for
from turbospark.state import State
from turbospark.synthetic import build_checked
from turbospark.vision import VisionMap
from turbospark_qwen_gdn import synthetic
from turbospark_qwen_gdn.model import QwenGdn, QwenGdnConfig, sanitize
from turbospark_qwen_gdn.state import COMPONENTS, new_state


@hookimpl
def turbospark_family() -> FamilySpec:
    return FamilySpec(
        name="qwen_gdn",
        # HF's text sub-config is "qwen3_5_text", but checkpoints (and mlx-lm) use "qwen3_5".
        model_types=["qwen3_5", "qwen3_5_text"],
        arch_config=QwenGdnConfig,
        components=COMPONENTS,
        state_source="plugins/qwen_gdn/turbospark_qwen_gdn/state.py",
    )


@hookimpl
def turbospark_pool_capability(arch: ArchConfig) -> list[str]:
    return [spec.name for spec in COMPONENTS if spec.swappable]


@hookimpl
def turbospark_load_model(
    arch: ArchConfig, weights: dict[str, mx.array], dtype: mx.Dtype
) -> nn.Module:
    assert isinstance(arch, QwenGdnConfig)
    return load_checked(QwenGdn(arch), sanitize(weights, arch), dtype)


@hookimpl
def turbospark_new_state(arch: ArchConfig, model: nn.Module, context_length: int) -> State:
    assert isinstance(arch, QwenGdnConfig)
    return new_state(arch)


@hookimpl
def turbospark_forward(
    model: nn.Module,
    tokens: mx.array,
    start: int,
    state: State,
    vision: VisionMap | None,
    logits: LogitsWanted,
) -> mx.array | None:
    hidden = model(tokens[None], start, state, vision)[0]  # (L, hidden)
    return logits_for(hidden, model.head, logits)


@hookimpl
def turbospark_forward_batch(
    model: nn.Module, tokens: mx.array, positions: list[int], state: State, logits: LogitsWanted
) -> mx.array | None:
    hidden = model(tokens, mx.array(positions), state)  # (B, L, hidden)
    return batch_logits_for(hidden, model.head, logits)


@hookimpl
def turbospark_build_synthetic_install(path: Path, dims: dict[str, Any]) -> ArchConfig:
    return build_checked("qwen_gdn", synthetic.build, path, dims)
