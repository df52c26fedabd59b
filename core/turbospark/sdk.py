"""The family SDK: everything a model family imports from turbospark, and nothing else.

A family is a pip-installable pluggy plugin (entry-point group ``turbospark``)
whose modules import only from here; the rest of turbospark is internal and
may change between any two releases. The guide is
``examples/third_party_family/README.md``; the kit that proves a family is
:mod:`turbospark.conformance`.

Versioning. :data:`API_VERSION` is semantic: a new name is a minor release, a
removed or changed one a major release. A name that is removed or renamed
keeps working for one minor version with a :class:`DeprecationWarning` that
names its replacement; ``docs/SDK_CHANGES.md`` lists every change. A plugin
declares the versions it supports with a module-level specifier::

    TURBOSPARK_SDK = ">=1.0,<2"

and discovery refuses, by name, a plugin whose range excludes this version
(``turbospark families`` shows why).

What is here, in the order a family meets it:

* the contract -- :data:`hookimpl`, the hooks themselves (``help(turbospark.sdk.hookspecs)``
  shows every hook's signature and what it must do), their value types
  (:class:`FamilySpec`, :class:`ArchConfig`, :class:`ComponentSpec`,
  :class:`MoESpec` ...) and the protocols of what hooks receive
  (:class:`LayerHook`, :class:`Join`, :class:`MultiTokenHead`,
  :class:`ExpertStreams`), vision inputs;
* state -- the component protocol and the attention K/V components a family
  composes (:class:`KVComponent`, :class:`LayeredComponent`), batched ones;
* layers -- attention over the K/V components, RoPE, the gated MLP, the
  gated-DeltaNet mixer, its state and its one-trace decode step, routed experts, stacked projections,
  compiled elementwise chains, the LM head, a layer's end (:class:`LayerEnd`:
  the residual joins and the MLP, stated as an architecture), the one-trace
  layer steps (which take the CUDA kernels themselves where they run) and the
  kernels' layers;
* sharding -- tensor-parallel helpers for ``turbospark_shard_model``;
* steering -- :func:`joiner`, a layer's last residual join with its steering;
* installs -- loading checked weights, the checkpoint's config, the hooks
  every family writes the same way (:class:`CommonHooks`), synthetic
  installs for tests (:func:`write_synthetic`, :class:`RandomWeights`), the
  install's text (:func:`load_text`) and an installed family's hooks as the
  runner calls them (:func:`family_hooks`, for a family's own tests).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from turbospark.contract import API_VERSION, hookspecs
from turbospark.contract.hookspecs import (
    ArchConfig,
    ComponentSpec,
    ExpertProjection,
    ExpertSlice,
    FamilySpec,
    LogitsWanted,
    MoESpec,
    hookimpl,
)
from turbospark.contract.protocols import (
    ExpertGroup,
    ExpertSlots,
    ExpertStreams,
    Join,
    LayerHook,
    MultiTokenHead,
    Parts,
)
from turbospark.contract.vision import MropePositions, VisionInjection, VisionMap
from turbospark.errors import InstallError, InvalidInput, RewindError
from turbospark.layers import fused
from turbospark.layers.attention import (
    Attended,
    cached_attention,
    heads_first,
    merge_heads,
    normed_heads,
    shared_attention,
)
from turbospark.layers.attention_step import AttentionStep
from turbospark.layers.cuda.heads import norm_rope, norm_rope_ops
from turbospark.layers.cuda.norm import Unjoined, normed_input
from turbospark.layers.experts import ExpertLayer, ExpertTable, PackedExperts, gather_experts
from turbospark.layers.fused import (
    geglu,
    runs_compiled,
    sigmoid_gate,
    softcap,
    swiglu,
)
from turbospark.layers.gated_delta.layer import GatedDeltaNet, GDNDims
from turbospark.layers.gated_delta.state import GDNComponent
from turbospark.layers.gated_delta.step import gated_delta_layer_step
from turbospark.layers.layer_end import EndWeights, LayerEnd, step_end
from turbospark.layers.layer_step import (
    Stream,
    attend,
    cache_step,
    flat,
    kernel_cache,
    kernel_rows,
    kernels_available,
    kernels_take,
    lifted,
    normed_stream,
    stream_of,
    written,
)
from turbospark.layers.logits import batch_logits_for, logits_for
from turbospark.layers.mlp import GatedMLP
from turbospark.layers.rope import apply_rope, rope_freqs
from turbospark.layers.sharding import (
    kv_copies,
    require_divisible,
    require_whole_groups,
    shard_attention,
    shard_experts,
    shard_gated_delta,
    shard_mlp,
)
from turbospark.layers.stacked import (
    Packed,
    PerModule,
    WeightT,
    derived,
    matmul_t,
    project,
    readable,
    stacked,
    transposed,
)
from turbospark.loading.checkpoint_config import HFConfig, arch_from_config
from turbospark.loading.family_hooks import CommonHooks, source_file
from turbospark.loading.install import (
    build_synthetic_install,
    load_checked,
    load_weights,
    peek_manifest_arch,
    read_manifest,
    write_install,
)
from turbospark.loading.plugins import family_hooks
from turbospark.loading.synthetic import (
    GEMMA_TEXT,
    QWEN_TEXT,
    RandomWeights,
    SyntheticText,
    write_synthetic,
)
from turbospark.policies.steering import joiner
from turbospark.state.components import (
    BatchedComponent,
    Capabilities,
    LayeredComponent,
    LayerPart,
    PadsRows,
    ShiftsRows,
    Snapshot,
    State,
    StateComponent,
    refuse_rewind,
    state_position,
)
from turbospark.state.kv import (
    BatchKV,
    BatchLayerKV,
    KVComponent,
    KVQuantization,
    LayerKV,
    QuantizedRows,
)
from turbospark.text import TextCodec, load_text

# A removed or renamed name -> (its replacement, the version that removes it). Served by
# __getattr__ with a DeprecationWarning for one minor version; docs/SDK_CHANGES.md lists each.
DEPRECATED: dict[str, tuple[str, str]] = {}


__all__ = [  # noqa: RUF022 -- grouped as the docstring lists them
    "API_VERSION",
    # the contract
    "hookimpl",
    "hookspecs",
    "ArchConfig",
    "ComponentSpec",
    "FamilySpec",
    "LogitsWanted",
    "MoESpec",
    "ExpertProjection",
    "ExpertSlice",
    "LayerHook",
    "Join",
    "Parts",
    "MultiTokenHead",
    "ExpertStreams",
    "ExpertSlots",
    "ExpertGroup",
    "MropePositions",
    "VisionInjection",
    "VisionMap",
    "InstallError",
    "InvalidInput",
    "RewindError",
    # state
    "State",
    "StateComponent",
    "Capabilities",
    "Snapshot",
    "LayeredComponent",
    "LayerPart",
    "BatchedComponent",
    "ShiftsRows",
    "PadsRows",
    "state_position",
    "refuse_rewind",
    "LayerKV",
    "KVComponent",
    "BatchLayerKV",
    "BatchKV",
    "KVQuantization",
    "QuantizedRows",
    # layers
    "Attended",
    "cached_attention",
    "shared_attention",
    "heads_first",
    "merge_heads",
    "normed_heads",
    "apply_rope",
    "rope_freqs",
    "GatedMLP",
    "ExpertLayer",
    "ExpertTable",
    "PackedExperts",
    "gather_experts",
    "GatedDeltaNet",
    "GDNDims",
    "GDNComponent",
    "gated_delta_layer_step",
    "project",
    "stacked",
    "transposed",
    "matmul_t",
    "readable",
    "Packed",
    "PerModule",
    "WeightT",
    "derived",
    "fused",
    "runs_compiled",
    "geglu",
    "swiglu",
    "sigmoid_gate",
    "softcap",
    "logits_for",
    "batch_logits_for",
    "Stream",
    "stream_of",
    "normed_stream",
    "LayerEnd",
    "AttentionStep",
    "normed_input",
    "EndWeights",
    "step_end",
    "flat",
    "lifted",
    "kernels_available",
    "kernels_take",
    "kernel_cache",
    "kernel_rows",
    "cache_step",
    "written",
    "attend",
    "norm_rope",
    "norm_rope_ops",
    "Unjoined",
    # sharding
    "require_divisible",
    "kv_copies",
    "shard_attention",
    "shard_mlp",
    "shard_gated_delta",
    "shard_experts",
    "require_whole_groups",
    # steering
    "joiner",
    # installs
    "HFConfig",
    "arch_from_config",
    "CommonHooks",
    "source_file",
    "load_checked",
    "load_weights",
    "read_manifest",
    "write_install",
    "peek_manifest_arch",
    "build_synthetic_install",
    "write_synthetic",
    "RandomWeights",
    "SyntheticText",
    "GEMMA_TEXT",
    "QWEN_TEXT",
    "load_text",
    "TextCodec",
    "family_hooks",
]


def __getattr__(name: str) -> Any:
    if name in DEPRECATED:
        replacement, removal = DEPRECATED[name]
        warnings.warn(
            f"turbospark.sdk.{name} is deprecated and goes in SDK {removal}; use {replacement}",
            DeprecationWarning,
            stacklevel=2,
        )
        module, _, attr = replacement.rpartition(".")
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'turbospark.sdk' has no attribute {name!r}")
