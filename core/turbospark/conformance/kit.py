"""The harness every conformance check works through: one family, one model (an
install, a checkpoint directory or a hub id, resolved once by
:func:`~turbospark.loading.sources.resolve_source`).

A :class:`FamilyKit` drives the family two ways. Session checks go through
:class:`~turbospark.Runner`, the path users take. Component checks call the
family's hooks directly (load, new state, forward), so a fault is pinned on
the family rather than on the runner. References ("a fresh single-session run
of this history") come from the hooks too, each on a model *of its own*
(built from a private copy of the install's tensors) and cached per history:
a family that keeps state on its model object cannot pollute one reference
with another's tokens, nor with the tokens of the runs under test.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from turbospark.conformance.diagnose import (
    fingerprint_changes,
    model_fingerprint,
    session_states,
    shared_components,
)
from turbospark.contract.hookspecs import ArchConfig, ComponentSpec, FamilySpec, LogitsWanted
from turbospark.contract.protocols import LayerHook
from turbospark.generation.runner import Runner
from turbospark.loading.install import load_weights, validate_arch
from turbospark.loading.plugins import Family, FamilyRegistry, default_registry
from turbospark.loading.sources import ModelSource, resolve_source
from turbospark.policies import DraftPolicies
from turbospark.policies.steering import SteeringPolicy
from turbospark.state.components import State

EXAMPLES_ENV = "TURBOSPARK_CONFORMANCE_EXAMPLES"


def examples_from_env(default: int) -> int:
    """Hypothesis examples per interleaving check: ``TURBOSPARK_CONFORMANCE_EXAMPLES``
    overrides the class's ``max_examples`` (CI keeps it small, a soak raises it)."""
    value = os.environ.get(EXAMPLES_ENV)
    if value is None:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{EXAMPLES_ENV} must be a positive integer, got {value!r}")
    return int(value)


@dataclass
class FreshRun:
    """One reference run: its own model and a state of it, fed from position 0."""

    kit: FamilyKit
    model: Any
    state: State = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state = self.kit.new_state(self.model)

    def forward(
        self, tokens: Sequence[int], start: int, logits: LogitsWanted = "last"
    ) -> mx.array | None:
        return self.kit.forward(self.state, tokens, start, logits, model=self.model)


def kit_settings(kit: FamilyKit) -> settings:
    """How the kit's property checks run: reproducible (derandomized, no example
    database), no deadline on a CPU shared with other work, and one bug reported."""
    return settings(
        max_examples=kit.examples,
        deadline=None,
        database=None,
        derandomize=True,
        print_blob=False,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )


@dataclass
class FamilyKit:
    """A family, a model of it, and the tolerances its logits are compared with."""

    family: Family
    registry: FamilyRegistry
    source: ModelSource
    atol: float = 1e-4
    rtol: float = 1e-4
    examples: int = 15
    context_length: int = 1024
    _references: dict[tuple[tuple[int, ...], LogitsWanted], mx.array] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def create(
        cls,
        family: str,
        install: str | Path | ModelSource,
        registry: FamilyRegistry | None = None,
        **options: Any,
    ) -> FamilyKit:
        registry = registry or default_registry()
        source = resolve_source(install, registry=registry)
        return cls(registry.get(family), registry, source, **options)

    # -- what the family declares ------------------------------------------------

    @property
    def install(self) -> Path:
        """The model's directory (a hub id's snapshot, for one)."""
        return self.source.path

    @property
    def spec(self) -> FamilySpec:
        return self.family.spec

    def component(self, name: str) -> ComponentSpec:
        return self.spec.component(name)

    @cached_property
    def arch(self) -> ArchConfig:
        return validate_arch(self.install, self.source.manifest, self.spec.arch_config)

    @cached_property
    def hook(self) -> Any:
        return self.family.manager().hook

    @cached_property
    def swappable(self) -> list[str]:
        """What ``turbospark_pool_capability`` says this install's arch can park."""
        return list(self.hook.turbospark_pool_capability(arch=self.arch))

    @property
    def not_swappable(self) -> list[str]:
        return [c.name for c in self.spec.components if c.name not in self.swappable]

    def require_pool(self) -> None:
        """Skip a pool check for a family that (rightly) refuses a pool."""
        if self.not_swappable:
            pytest.skip(f"not swappable: {', '.join(self.not_swappable)}")

    # -- driving the hooks directly -----------------------------------------------

    @cached_property
    def weights(self) -> dict[str, mx.array]:
        """The install's tensors, read once; every model is built from a copy."""
        return load_weights(self.install, self.source.manifest)

    def load_model(self) -> Any:
        """A new model object over a private copy of the tensors: nothing done
        to one model (an attribute set, a weight written in place) reaches
        another. On a synthetic install this costs a few milliseconds."""
        return self.hook.turbospark_load_model(
            arch=self.arch,
            weights={name: mx.array(tensor) for name, tensor in self.weights.items()},
            dtype=mx.float32,
            experts=None,
        )

    @cached_property
    def model(self) -> Any:
        """The model every state under test runs on."""
        return self.load_model()

    @cached_property
    def _warmed(self) -> dict[str, str]:
        """The fingerprint of a new model after a chunk, a decode step and a
        chunk without logits: what it caches from its weights on first use
        (transposed or stacked projections) is there, no session's tokens are."""
        run = self.fresh_run()
        for tokens, start, logits in (([0, 1, 2], 0, "all"), ([3], 3, "last"), ([4, 5], 4, "none")):
            run.forward(tokens, start, logits)  # type: ignore[arg-type]
        return model_fingerprint(run.model)

    def model_changes(self, model: Any) -> list[str]:
        """What *model* holds that a new model, warmed up on a few tokens of its
        own, does not (attributes added, containers grown, arrays reshaped,
        counters moved): conversation state kept on the model object."""
        return fingerprint_changes(self._warmed, model_fingerprint(model))

    def new_state(self, model: Any = None) -> State:
        """A new state of *model* (default: the model under test)."""
        return self.hook.turbospark_new_state(
            arch=self.arch,
            model=self.model if model is None else model,
            context_length=self.context_length,
        )

    def forward(
        self,
        state: State,
        tokens: Sequence[int],
        start: int,
        logits: LogitsWanted = "last",
        *,
        model: Any = None,
        steer: LayerHook | None = None,
    ) -> mx.array | None:
        """``turbospark_forward`` on *model* (default: the model under test)."""
        out = self.hook.turbospark_forward(
            model=self.model if model is None else model,
            tokens=mx.array(list(tokens), dtype=mx.int32),
            start=start,
            state=state,
            vision=None,
            logits=logits,
            steer=steer,
        )
        mx.eval(*([] if out is None else [out]), *(a for c in state.values() for a in c.arrays()))
        return out

    def prefilled_state(self, history: Sequence[int]) -> State:
        """A new state of the model under test after *history* in one chunk."""
        state = self.new_state()
        self.forward(state, history, 0, "none")
        return state

    def fresh_run(self, history: Sequence[int] = ()) -> FreshRun:
        """A reference: a model loaded for it alone, and a new state of that
        model after *history* in one chunk."""
        run = FreshRun(self, self.load_model())
        if history:
            run.forward(history, 0, "none")
        return run

    def fresh_logits(self, history: Sequence[int], logits: LogitsWanted = "last") -> mx.array:
        """Logits after *history* fed in one chunk to a fresh state of a model
        loaded for this reference alone (``(vocab,)``, or ``(L, vocab)`` for "all")."""
        key = (tuple(int(t) for t in history), logits)
        if key not in self._references:
            out = self.fresh_run().forward(key[0], 0, logits)
            assert out is not None
            self._references[key] = out
        return self._references[key]

    def fresh_state(self, history: Sequence[int]) -> State:
        """A fresh state after *history*, on a model loaded for it alone: what a
        state that holds this conversation should contain."""
        return self.fresh_run(history).state

    # -- the user's path --------------------------------------------------------

    def open(
        self,
        session_slots: int = 1,
        *,
        reuse: bool = True,
        context: str = "",
        steering: SteeringPolicy | None = None,
        draft: DraftPolicies | None = None,
    ) -> Runner:
        """A runner over the model; fails first if its sessions share a component."""
        runner = Runner.open(
            self.source,
            context_length=self.context_length,
            session_slots=session_slots,
            registry=self.registry,
            dtype=mx.float32,
            steering=steering,
            draft=draft,
        )
        runner.set_prefix_reuse(reuse)
        self.check_apart(runner, f"{context}Runner.open(session_slots={session_slots}): ")
        return runner

    def check_apart(self, runner: Runner, context: str) -> None:
        """No component object may be held by two sessions, or handed out again by
        ``turbospark_new_state``: it would corrupt the reference run too, so no
        logits comparison could say what leaked."""
        __tracebackhide__ = True
        shared = shared_components([*session_states(runner), ("a new state", self.new_state())])
        if shared:
            raise AssertionError(context + "; ".join(shared))

    # -- inputs and comparisons ----------------------------------------------------

    def tokens(self, seed: int, n: int) -> list[int]:
        """*n* reproducible token ids of this install's vocabulary."""
        rng = np.random.default_rng(seed)
        return [int(t) for t in rng.integers(0, self.arch.vocab_size, n)]

    def logits_gap(self, actual: mx.array | None, expected: mx.array) -> float | None:
        """None when the logits agree within tolerance, else the largest difference."""
        if actual is None:
            return float("inf")
        a, e = np.asarray(actual, dtype=np.float32), np.asarray(expected, dtype=np.float32)
        if a.shape == e.shape and np.allclose(a, e, atol=self.atol, rtol=self.rtol):
            return None
        return float(np.max(np.abs(a - e))) if a.shape == e.shape else float("inf")
