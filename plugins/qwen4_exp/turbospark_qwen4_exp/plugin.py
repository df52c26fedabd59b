"""The qwen4_exp family's hook implementations (entry point ``turbospark:qwen4_exp``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from turbospark.errors import InvalidInput
from turbospark.hookspecs import ArchConfig, FamilySpec, LogitsWanted, hookimpl
from turbospark.install import load_checked
from turbospark.layers.logits import logits_for
from turbospark.state import State, state_position
from turbospark.synthetic import build_checked
from turbospark.vision import VisionMap
from turbospark_qwen4_exp import synthetic
from turbospark_qwen4_exp.model import Qwen4Exp, Qwen4ExpConfig, sanitize
from turbospark_qwen4_exp.state import COMPONENTS, new_state


@hookimpl
def turbospark_family() -> FamilySpec:
    return FamilySpec(
        name="qwen4_exp",
        model_types=["qwen4_exp"],
        arch_config=Qwen4ExpConfig,
        components=COMPONENTS,
        state_source="plugins/qwen4_exp/turbospark_qwen4_exp/state.py",
    )


@hookimpl
def turbospark_pool_capability(arch: ArchConfig) -> list[str]:
    return [spec.name for spec in COMPONENTS if spec.swappable]


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
def turbospark_forward(
    model: nn.Module,
    tokens: mx.array,
    start: int,
    state: State,
    vision: VisionMap | None,
    logits: LogitsWanted,
) -> mx.array | None:
    if state_position(state) != start:
        # The n-gram context and conv tail only continue from where they stopped.
        raise InvalidInput(
            f"qwen4_exp state is at position {state_position(state)}, asked to write at {start}; "
            "rewind or reset the session first"
        )
    hidden = model(tokens, start, state, vision)  # (L, hidden)
    return logits_for(hidden, model.head, logits)


@hookimpl
def turbospark_build_synthetic_install(path: Path, dims: dict[str, Any]) -> ArchConfig:
    return build_checked("qwen4_exp", synthetic.build, path, dims)
