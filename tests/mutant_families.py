"""A wrapper family for planting one fault in a real family, and its kit.

:class:`MutantGemma4` is the real gemma4 plugin under another name, with a
*mutation* applied to every new state; the ``mutant_kit`` fixture registers
one (``request.param`` is ``(name, mutation)``, or ``(name, mutation, subclass)``
for a fault in a hook other than the new state), builds its synthetic install
and unregisters it afterwards. :class:`BatchingGemma4` adds the batched forward
(so the batch checks run); :class:`CacheOnTheModel` keeps conversation state on
the model object. The conformance kit must fail each mutant
naming the fault, and pass the unmutated wrapper (mutation ``None``), so the
failures are the fault's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from turbospark.conformance import FamilyKit
from turbospark.contract.hookspecs import ArchConfig, FamilySpec, LogitsWanted, hookimpl
from turbospark.contract.protocols import LayerHook
from turbospark.contract.vision import VisionMap
from turbospark.loading.install import MANIFEST, read_manifest
from turbospark.loading.plugins import FamilyRegistry, default_registry
from turbospark.state.components import State

Mutation = Callable[[State, nn.Module], State]
"""A fault: the new state (and the model it was built for) -> the state to hand out."""


class MutantGemma4:
    """gemma4 (the plugin module *base*) under another family name, with
    *mutation* applied to every new state."""

    def __init__(self, name: str, mutation: Mutation | None, base: Any) -> None:
        self.name = name
        self.mutation = mutation
        self.base = base

    @hookimpl
    def turbospark_family(self) -> FamilySpec:
        spec = self.base.turbospark_family()
        return spec.model_copy(update={"name": self.name, "model_types": [f"{self.name}_text"]})

    @hookimpl
    def turbospark_pool_capability(self, arch: ArchConfig) -> list[str]:
        return self.base.turbospark_pool_capability(arch=arch)

    @hookimpl
    def turbospark_load_model(
        self, arch: ArchConfig, weights: dict[str, mx.array], dtype: mx.Dtype, experts: Any
    ) -> nn.Module:
        return self.base.turbospark_load_model(
            arch=arch, weights=weights, dtype=dtype, experts=experts
        )

    @hookimpl
    def turbospark_moe(self, arch: ArchConfig) -> Any:
        return self.base.turbospark_moe(arch=arch)

    @hookimpl
    def turbospark_new_state(
        self, arch: ArchConfig, model: nn.Module, context_length: int
    ) -> State:
        state = self.base.turbospark_new_state(
            arch=arch, model=model, context_length=context_length
        )
        return state if self.mutation is None else self.mutation(state, model)

    @hookimpl
    def turbospark_forward(
        self,
        model: nn.Module,
        tokens: mx.array,
        start: int,
        state: State,
        vision: VisionMap | None,
        logits: LogitsWanted,
        steer: LayerHook | None,
    ) -> mx.array | None:
        return self.base.turbospark_forward(
            model=model,
            tokens=tokens,
            start=start,
            state=state,
            vision=vision,
            logits=logits,
            steer=steer,
        )

    @hookimpl
    def turbospark_build_synthetic_install(self, path: Path, dims: dict[str, Any]) -> ArchConfig:
        arch = self.base.turbospark_build_synthetic_install(path=path, dims=dims)
        manifest = read_manifest(path).model_copy(update={"family": self.name})
        (path / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
        return arch.model_copy(update={"family": self.name})


class BatchingGemma4(MutantGemma4):
    """The wrapper with gemma4's batched forward too, so the batch checks run
    (a :class:`MutantGemma4` alone is decoded one row at a time)."""

    @hookimpl
    def turbospark_forward_batch(
        self,
        model: nn.Module,
        tokens: mx.array,
        positions: list[int],
        state: State,
        logits: LogitsWanted,
        steer: LayerHook | None,
    ) -> mx.array | None:
        return self.base.turbospark_forward_batch(
            model=model, tokens=tokens, positions=positions, state=state, logits=logits, steer=steer
        )


class CacheOnTheModel(MutantGemma4):
    """Keeps every token it is fed in a list on the model object (a repetition
    penalty written as if the model served one conversation) and lowers those
    tokens' logits. Every session and every new state shares the list, and
    so, when references share one model, does every reference."""

    PENALTY = 0.5

    @hookimpl
    def turbospark_forward(
        self,
        model: nn.Module,
        tokens: mx.array,
        start: int,
        state: State,
        vision: VisionMap | None,
        logits: LogitsWanted,
        steer: LayerHook | None,
    ) -> mx.array | None:
        out = self.base.turbospark_forward(
            model=model,
            tokens=tokens,
            start=start,
            state=state,
            vision=vision,
            logits=logits,
            steer=steer,
        )
        if "seen_tokens" not in model:
            model.seen_tokens = []  # nn.Module keeps a list attribute among its children
        model.seen_tokens.append(tokens)
        if out is None:
            return None
        seen = mx.concatenate(model.seen_tokens)
        counts = mx.zeros((out.shape[-1],), out.dtype).at[seen].add(1.0)  # (vocab,)
        return out - self.PENALTY * counts


@pytest.fixture
def mutant_kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FamilyKit]:
    """A kit over a freshly registered mutant, unregistered afterwards."""
    name, mutation, *wrapper = request.param  # optionally a MutantGemma4 subclass
    plugin = (wrapper or [MutantGemma4])[0](name, mutation, default_registry().get("gemma4").plugin)
    registry = FamilyRegistry()
    registry.register(plugin, name=name)
    try:
        arch = (
            registry.get(name)
            .manager()
            .hook.turbospark_build_synthetic_install(
                path=tmp_path, dims={"num_layers": 2, "sliding_window": 8}
            )
        )
        assert arch.family == name
        yield FamilyKit.create(name, tmp_path, registry, examples=10)
    finally:
        registry.unregister(name)
