"""The family contract: what a model-family plugin provides to turbospark.

Read this file first. A family is a pluggy plugin (a module or object with
``@hookimpl`` functions) registered under the entry-point group ``turbospark``.
A runner builds its own plugin manager holding exactly one family plugin, so
family hooks take no "which family" argument and are all ``firstresult``.

Lifecycle, in the order a runner calls the hooks:

1. declare   -- :func:`turbospark_family`, :func:`turbospark_pool_capability`,
   :func:`turbospark_moe`, :func:`turbospark_tool_syntax`
2. load      -- :func:`turbospark_load_model`, :func:`turbospark_shard_model`
3. serve     -- :func:`turbospark_new_state`, :func:`turbospark_forward`
                (optional: :func:`turbospark_forward_batch`, :func:`turbospark_forward_hidden`;
                for ``DraftPolicies.mtp``: :func:`turbospark_mtp_head`,
                :func:`turbospark_forward_with_hidden`)
4. persist   -- :func:`turbospark_snapshot_state`, :func:`turbospark_restore_state`
5. tooling   -- :func:`turbospark_build_synthetic_install`
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pluggy
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

    from turbospark.contract.protocols import ExpertStreams, LayerHook, MultiTokenHead
    from turbospark.contract.vision import VisionMap
    from turbospark.state.components import Capabilities, State

hookspec = pluggy.HookspecMarker("turbospark")
hookimpl = pluggy.HookimplMarker("turbospark")

LogitsWanted = Literal["last", "all", "none"]

# The tool-call syntaxes the server reads and forces (turbospark.server.tools):
# Qwen3's Hermes-style ``<tool_call>{json}</tool_call>`` (the default), Qwen3.5's
# ``<tool_call><function=NAME><parameter=K>...`` and Gemma 4's
# ``<|tool_call>call:NAME{...}<tool_call|>``.
ToolSyntaxName = Literal["qwen3_json", "qwen3_xml", "gemma4"]
TOOL_SYNTAXES: tuple[str, ...] = ("qwen3_json", "qwen3_xml", "gemma4")
DEFAULT_TOOL_SYNTAX = "qwen3_json"


class ArchConfig(BaseModel):
    """A family's architecture, read from the Hugging Face ``config.json``.

    Subclasses add fields under the checkpoint's own key names (rule: config
    fields use the checkpoint's names) so ``config.json`` validates directly.
    ``family`` is ours: it is written into the manifest, never into config.json.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    family: str
    model_type: str
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    eos_token_id: int | list[int] | None = None

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` this arch writes: every field the config class
        declares but ``family``, a None written as null, never omitted (a missing
        key means the family default, a null means none; mlx-lm requires some,
        such as ``head_dim``). ``tests/test_synthetic_configs.py`` holds it to that."""
        return self.model_dump(mode="json", exclude={"family"})

    def attention_head_dims(self) -> set[int]:
        """The head dims of its attention layers' keys and values, so a
        ``--kv-group-size`` that does not divide one is refused before any
        weight is read. Defaults to the checkpoint's ``head_dim`` where it has
        one; a family whose layers differ (Gemma 4's global heads) overrides it."""
        head_dim = getattr(self, "head_dim", None)
        return {head_dim} if isinstance(head_dim, int) and head_dim > 0 else set()


class ComponentSpec(BaseModel):
    """One kind of per-session state and what the runner may do with it."""

    model_config = ConfigDict(frozen=True)

    name: str
    description: str
    swappable: bool = Field(description="may be parked in a pool slot and resumed later")
    rewindable: bool | Literal["window"] = Field(
        description="may be truncated in place; 'window' means only within its ring's headroom"
    )
    persistable: bool = Field(description="snapshot()/restore() round-trip through arrays")
    batchable: bool = Field(
        default=False,
        description="merges with other sessions' along the batch axis for one decode step "
        "(the component class has merge(); see turbospark.state.kv)",
    )
    traceable: bool = Field(
        default=False,
        description="keeps its state after every token of a verify forward (the component "
        "class has trace(), held_trace() and keep_traced(n, held=None); see "
        "turbospark.generation.speculation), so a non-rewindable component can drop rejected draft "
        "tokens without a second forward, even after a later verify forward",
    )

    @classmethod
    def of(
        cls, capabilities: Capabilities, name: str, description: str, **narrowed: Any
    ) -> ComponentSpec:
        """The spec of a component whose class declares *capabilities* (its
        ``CAPABILITIES``), so the declaration is the class's own. A family may
        narrow a capability it has not proven for its use (``swappable=False``),
        never widen one: that would promise behaviour the class lacks."""
        declared = vars(capabilities)
        for field, value in narrowed.items():
            if field not in declared:
                raise TypeError(f"ComponentSpec.of: {field!r} is not a capability")
            if _RANK[value] > _RANK[declared[field]]:
                raise ValueError(
                    f"component '{name}': {field}={value!r} widens its class's "
                    f"{field}={declared[field]!r}"
                )
        return cls(name=name, description=description, **{**declared, **narrowed})


# How much each capability value allows, to tell a narrowing from a widening.
_RANK: dict[bool | str, int] = {False: 0, "window": 1, True: 2}


class FamilySpec(BaseModel):
    """What :func:`turbospark_family` returns: the family's name, types and state."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    name: str
    model_types: list[str] = Field(description="Hugging Face model_type values this family loads")
    arch_config: type[ArchConfig]
    components: list[ComponentSpec]
    state_source: str = Field(
        description="the file defining the state, named in refusals; derive it "
        "(turbospark.sdk.source_file(state_module), or let CommonHooks do it) so it is right "
        "wherever the family is installed"
    )
    steerable: bool = Field(
        default=False,
        description="its forward hooks take ``steer`` and call it at every layer's output "
        "(after the feed-forward residual join); a family that does not is refused steering",
    )
    kv_quantizable: bool = Field(
        default=False,
        description="its attention runs through turbospark.layers.attention (cached_attention, "
        "shared_attention) over its KVComponents, which then read a quantized K/V cache "
        "(--kv-bits); a family attending over its K/V itself is refused it",
    )

    def component(self, name: str) -> ComponentSpec:
        for spec in self.components:
            if spec.name == name:
                return spec
        raise KeyError(name)


class ExpertSlice(BaseModel):
    """One place in the install where a projection of a layer's experts may live:
    a tensor ``(num_experts, rows, in)`` whose band ``rows`` of axis 1 is the
    projection's ``(out, in)`` matrix for each expert (a fused ``gate_up``
    tensor holds two bands; a split one is the whole axis)."""

    model_config = ConfigDict(frozen=True)

    tensor: str = Field(description="the install's (Hugging Face) tensor name")
    rows: tuple[int, int] | None = Field(
        default=None, description="[start, stop) along axis 1; None: the whole axis"
    )


class ExpertProjection(BaseModel):
    """One stacked expert matrix of an :class:`~turbospark.layers.experts.ExpertLayer`
    and the install layouts it may be read from, tried in order."""

    model_config = ConfigDict(frozen=True)

    shape: tuple[int, int] = Field(description="(out, in) of one expert's matrix")
    sources: list[ExpertSlice] = Field(min_length=1)


class MoESpec(BaseModel):
    """What :func:`turbospark_moe` returns: the family's routed experts, so the
    runner can keep only some of them resident (``ExpertCacheSlots``) and stream
    the rest from the install's safetensors."""

    model_config = ConfigDict(frozen=True)

    num_experts: int = Field(gt=0)
    top_k: int = Field(gt=0, description="experts each token routes to")
    layers: dict[str, dict[str, ExpertProjection]] = Field(
        description="module path of each ExpertLayer (e.g. 'model.layers.0.experts') -> "
        "its parameter name -> where that projection lives in the install"
    )


# -- 1. declare ---------------------------------------------------------------


@hookspec(firstresult=True)
def turbospark_family() -> FamilySpec:
    """Declare the family: name, accepted HF ``model_type`` values, arch config
    class and every state component with its capabilities."""


@hookspec(firstresult=True)
def turbospark_pool_capability(arch: ArchConfig) -> list[str]:
    """Names of the components this *arch* can park and resume.

    The runner refuses ``session_slots > 1`` by name when any component of a
    fresh state is missing from this list.
    """


@hookspec(firstresult=True)
def turbospark_moe(arch: ArchConfig) -> MoESpec | None:
    """Declare the routed experts of *arch* (``None``, or no implementation:
    not a mixture of experts). A family that declares them builds its expert
    blocks as :class:`turbospark.layers.experts.ExpertLayer` and takes the
    ``experts`` argument of :func:`turbospark_load_model`; the conformance kit
    then checks that every ``ExpertCacheSlots`` gives the same logits.
    """


@hookspec(firstresult=True)
def turbospark_tool_syntax(chat_template: str | None) -> str | None:
    """The syntax this family's models write tool calls in, one of
    :data:`TOOL_SYNTAXES`, given the install's *chat_template* (a family whose
    checkpoints differ reads its own template). The server parses replies and
    forces calls in it; a name core does not implement is refused by name
    when the server loads. ``None``, or no implementation: ``"qwen3_json"``.
    """


# -- 2. load ------------------------------------------------------------------


@hookspec(firstresult=True)
def turbospark_load_model(
    arch: ArchConfig, weights: dict[str, mx.array], dtype: mx.Dtype, experts: ExpertStreams | None
) -> nn.Module:
    """Build the MLX module and load *weights* (Hugging Face tensor names).

    Use :func:`turbospark.loading.install.load_checked` so a missing or mis-shaped
    tensor is refused by name. *experts* (only for a family implementing
    :func:`turbospark_moe`; others leave the argument out) is set when the
    runner streams experts: call ``experts.attach(model)`` before loading, and
    *weights* then holds no expert tensors.
    """


@hookspec(firstresult=True)
def turbospark_quantize_overrides(arch: ArchConfig) -> dict[str, dict[str, int] | bool] | None:
    """Modules ``turbospark import --quantize`` packs unlike the rest, by path
    suffix: ``{"router.proj": {"bits": 8, "group_size": 64}}`` keeps a router at
    8 bits, ``False`` keeps a module in floating point (mlx-lm's
    ``quant_predicate``: match it where mlx-lm has the model, so both convert
    alike). ``None``, or no implementation: every module the group size fits
    is packed with the requested settings.
    """


@hookspec(firstresult=True)
def turbospark_shard_model(model: nn.Module, group: mx.distributed.Group) -> bool:
    """Shard the loaded *model* across *group* for tensor parallelism, in place,
    and return True: attention and MLP blocks split by head and width with the
    helpers of :mod:`turbospark.layers.sharding`, so the per-session state each block
    writes is sharded by head too. Refuse a group size that does not divide a
    head count with :class:`~turbospark.errors.InvalidInput`, before any weight
    moves. Optional: a family without it is refused by name when the group has
    more than one process.
    """


# -- 3. serve -----------------------------------------------------------------


@hookspec(firstresult=True)
def turbospark_new_state(arch: ArchConfig, model: nn.Module, context_length: int) -> State:
    """A fresh, empty session state: component name -> state component."""


@hookspec(firstresult=True)
def turbospark_forward(
    model: nn.Module,
    tokens: mx.array,
    start: int,
    state: State,
    vision: VisionMap | None,
    logits: LogitsWanted,
    steer: LayerHook | None,
) -> mx.array | None:
    """Advance *state* over ``tokens`` (shape ``(L,)``) at absolute positions
    ``start .. start+L-1``; every component's position is ``start`` on entry
    and must be ``start + L`` on return.

    Return float32 logits of shape ``(vocab,)`` for ``"last"``, ``(L, vocab)``
    for ``"all"``, and ``None`` for ``"none"`` (the head may be skipped).

    *steer* (only for a family whose spec says ``steerable``; others need not
    accept the argument): when not None, call ``h = steer(i, h)`` on layer
    ``i``'s output hidden states ``(1, L, hidden)``, after its feed-forward
    residual join, for every layer ``i`` (see :mod:`turbospark.policies.steering`).
    When None, run no extra op. Optionally, where a layer ends with the join
    ``(h + update) * scale`` (or ``h + update``), hand it over instead: with
    ``join = turbospark.policies.steering.joiner(steer, i)`` (None exactly when *steer*
    is), return ``join.fold(parts, args, scale, compiled)`` in place of both
    the join and ``steer(i, h)``, where ``parts(*args)`` is a module-level
    function over arrays that returns ``(h, update)`` (scale None for a plain
    add) and *compiled* says whether this step runs compiled
    (:func:`turbospark.layers.fused.runs_compiled`); or, holding the halves
    already, ``join(h, update, scale)``. Steering then costs no extra kernel
    for ``add`` and, in a compiled step, no extra compiled call in any mode
    (the kit checks both forms agree).
    """


@hookspec(firstresult=True)
def turbospark_forward_batch(
    model: nn.Module,
    tokens: mx.array,
    positions: list[int],
    state: State,
    logits: LogitsWanted,
    steer: LayerHook | None,
) -> mx.array | None:
    """Advance a *batched* state (every component merged by its ``merge``; see
    :mod:`turbospark.state.kv`) over ``tokens`` (shape ``(B, L)``), row ``i`` at
    absolute positions ``positions[i] ..``.

    Return float32 logits ``(B, vocab)`` for ``"last"``, ``(B, L, vocab)`` for
    ``"all"``, ``None`` for ``"none"``. Optional: a family that does not
    implement it (or has a component that is not ``batchable``) is decoded one
    row at a time through :func:`turbospark_forward`, with the same results.
    *steer* as in :func:`turbospark_forward`, on ``(B, L, hidden)``: it holds
    each row's own setting (zeros for a row that is not steered).
    """


@hookspec(firstresult=True)
def turbospark_forward_hidden(
    model: nn.Module, tokens: mx.array, start: int, state: State
) -> mx.array:
    """Advance *state* over ``tokens`` (shape ``(L,)``) at ``start ..``, as
    :func:`turbospark_forward` does, and return the final-normed hidden states
    ``(L, hidden)`` of every token, before the head.

    Optional: ``/v1/embeddings`` pools them (mean, L2-normalized). A family
    that does not implement it is refused there by name. The state is a
    throwaway the runner made for this call, never a session's.
    """


@hookspec(firstresult=True)
def turbospark_mtp_head(model: nn.Module) -> MultiTokenHead | None:
    """The model's multi-token-prediction head (:class:`turbospark.generation.mtp.MultiTokenHead`),
    or None when this install's checkpoint carries none.

    Optional, with :func:`turbospark_forward_with_hidden`: a family that has
    neither is refused ``DraftPolicies.mtp`` by name; nothing else changes.
    """


@hookspec(firstresult=True)
def turbospark_forward_with_hidden(
    model: nn.Module,
    tokens: mx.array,
    start: int,
    state: State,
    vision: VisionMap | None,
    logits: LogitsWanted,
    steer: LayerHook | None,
) -> tuple[mx.array | None, mx.array]:
    """:func:`turbospark_forward` that also returns the hidden states the MTP
    head reads, ``(L, hidden)`` for every token (the family says which: Qwen3.5's
    are final-normed). The runner calls it instead of :func:`turbospark_forward`
    for sessions of a runner that drafts with ``DraftPolicies.mtp``; required
    with :func:`turbospark_mtp_head`.
    """


# -- 4. persist ---------------------------------------------------------------


@hookspec(firstresult=True)
def turbospark_snapshot_state(state: State) -> dict[str, dict[str, mx.array]]:
    """Arrays-only copies of every persistable component (references to
    immutable MLX arrays are enough). Core provides a default."""


@hookspec(firstresult=True)
def turbospark_restore_state(state: State, snapshot: dict[str, dict[str, mx.array]]) -> bool:
    """Put a :func:`turbospark_snapshot_state` result back. Core provides a default."""


# -- 5. tooling ---------------------------------------------------------------


@hookspec(firstresult=True)
def turbospark_build_synthetic_install(path: Path, dims: dict[str, Any]) -> ArchConfig:
    """Write a random-weight install at *path* with real HF tensor names, through
    :func:`turbospark.loading.install.write_install` (the writer a real import uses).
    *dims* holds the keyword arguments of ``build_synthetic_install``."""
