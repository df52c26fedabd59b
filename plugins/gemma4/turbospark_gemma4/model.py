"""The Gemma 4 text decoder, computed exactly as mlx-lm's ``gemma4_text`` does.

One layer stack with two kinds of attention layer (``layer_types``):

- ``sliding_attention``: ``head_dim``, default RoPE (theta 10k), a window of
  ``sliding_window`` tokens;
- ``full_attention``: ``global_head_dim``, *proportional* partial RoPE (only a
  quarter of the pairs rotate; the rest pass through unchanged).

Both norm q and k (RMSNorm with a scale) and v (RMSNorm without one), and use
attention scale 1.0 (the norms already fix the logit size). The last
``num_kv_shared_layers`` layers own no K/V: each attends over the K/V of the
last earlier layer of its own type, and gets a double-wide MLP instead. The
E-sized models add per-layer input embeddings (PLE), the MoE models an expert
block beside the dense MLP. Every layer ends with a learned ``layer_scalar``;
the head is the tied embedding followed by a tanh logit softcap.

Shapes: hidden states are ``(B, L, hidden)``: one session is ``B = 1``, a
decode batch stacks several sessions, each at its own position (``start`` is
then an array of ``B`` positions; see :mod:`turbospark.state.kv`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import BaseModel, ConfigDict, Field, model_validator

from turbospark.sdk import (
    ArchConfig,
    Attended,
    AttentionStep,
    BatchLayerKV,
    ExpertLayer,
    ExpertProjection,
    ExpertSlice,
    ExpertTable,
    GatedMLP,
    Join,
    LayerEnd,
    LayerHook,
    LayerKV,
    MoESpec,
    State,
    Unjoined,
    VisionMap,
    WeightT,
    apply_rope,
    cached_attention,
    gather_experts,
    geglu,
    joiner,
    kernels_available,
    kv_copies,
    matmul_t,
    merge_heads,
    norm_rope,
    norm_rope_ops,
    normed_heads,
    normed_input,
    project,
    readable,
    require_divisible,
    require_whole_groups,
    rope_freqs,
    runs_compiled,
    shard_attention,
    shard_experts,
    shard_mlp,
    shared_attention,
    softcap,
    stacked,
    transposed,
)
from turbospark_gemma4.state import COMPONENTS, kv_slots

LayerType = Literal["sliding_attention", "full_attention"]


class RopeParameters(BaseModel):
    """One entry of ``rope_parameters`` (per layer type), as HF writes it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rope_type: Literal["default", "proportional"] = "default"
    rope_theta: float = 10000.0
    # Only "proportional" reads these two; "default" rotates the whole head.
    partial_rotary_factor: float = Field(1.0, gt=0.0, le=1.0)
    factor: float = 1.0


def _gemma4_rope() -> dict[LayerType, RopeParameters]:
    # The Gemma 4 release values, used by mlx-lm when config.json has no rope_parameters.
    return {
        "full_attention": RopeParameters(
            rope_type="proportional", rope_theta=1_000_000.0, partial_rotary_factor=0.25
        ),
        "sliding_attention": RopeParameters(rope_type="default", rope_theta=10_000.0),
    }


class LayerOverride(BaseModel):
    """One entry of transformers 5.x's ``per_layer_config``: what differs for that layer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    head_dim: int | None = Field(None, gt=0)
    num_key_value_heads: int | None = Field(None, gt=0)


class Gemma4Config(ArchConfig):
    """``config.json`` of a ``gemma4_text`` checkpoint (defaults are mlx-lm's, so a
    key missing from config.json means the same thing to both)."""

    model_type: Literal["gemma4_text"] = "gemma4_text"
    intermediate_size: int = Field(6144, gt=0)
    num_attention_heads: int = Field(8, gt=0)
    head_dim: int = Field(256, gt=0)
    # Full-attention layers use wider heads; None/0 means "same as head_dim".
    global_head_dim: int | None = 512
    rms_norm_eps: float = 1e-6
    vocab_size_per_layer_input: int = 262144
    num_key_value_heads: int = Field(1, gt=0)
    # Only read by full layers when attention_k_eq_v is on (26B/31B checkpoints).
    num_global_key_value_heads: int | None = None
    # The default of 20 fits the 35-layer E-models only; synthetic and other
    # checkpoints always write their own value.
    num_kv_shared_layers: int = Field(20, ge=0)
    pad_token_id: int = 0
    # 0 disables per-layer input embeddings (the MoE checkpoints have none).
    hidden_size_per_layer_input: int = Field(256, ge=0)
    rope_parameters: dict[LayerType, RopeParameters] = Field(default_factory=_gemma4_rope)
    sliding_window: int = Field(512, gt=0)
    # Only used to derive layer_types: (pattern - 1) sliding layers, then one full.
    sliding_window_pattern: int = Field(5, gt=0)
    max_position_embeddings: int = 131072
    # Full layers take values from the key projection (before k_norm and RoPE).
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = 30.0
    # Only KV-shared layers are double wide, and only when this is on.
    use_double_wide_mlp: bool = True
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    layer_types: list[LayerType] | None = None
    tie_word_embeddings: bool = True
    # transformers >= 5 writes the full layers' head dim (and KV heads) only here,
    # keyed by layer index; when present it replaces global_head_dim and
    # num_global_key_value_heads, as in transformers.
    per_layer_config: dict[int, LayerOverride] | None = None

    @model_validator(mode="before")
    @classmethod
    def _per_layer_config_replaces_globals(cls, data: Any) -> Any:
        # With per_layer_config, transformers never reads the two global keys, so an
        # absent one must not take mlx-lm's default (512) and then "conflict".
        if isinstance(data, dict) and data.get("per_layer_config") is not None:
            data = {"global_head_dim": None, "num_global_key_value_heads": None, **data}
        return data

    @model_validator(mode="after")
    def _derive_and_check(self) -> Gemma4Config:
        if self.layer_types is None:
            pattern = ["sliding_attention"] * (self.sliding_window_pattern - 1) + ["full_attention"]
            repeats = self.num_hidden_layers // len(pattern) + 1
            # Frozen model: set the derived default once, here, before anyone reads it.
            object.__setattr__(self, "layer_types", (pattern * repeats)[: self.num_hidden_layers])
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        if self.per_layer_config is not None:
            self._check_per_layer_config()
        owners = self.first_kv_shared_layer
        if owners == 0:
            raise ValueError(
                f"num_kv_shared_layers={self.num_kv_shared_layers} leaves no layer that owns K/V"
            )
        for i in range(owners, self.num_hidden_layers):
            if self.layer_types[i] not in self.layer_types[:owners]:
                raise ValueError(
                    f"KV-shared layer {i} is {self.layer_types[i]} but no earlier layer of that "
                    "type owns K/V to share"
                )
            source = self.kv_source(i)
            shape, shared = ((self.layer_kv_heads(j), self.layer_head_dim(j)) for j in (i, source))
            if shape != shared:
                raise ValueError(
                    f"KV-shared layer {i} has (kv heads, head dim) {shape} but shares the K/V "
                    f"of layer {source}, which has {shared}"
                )
        if self.enable_moe_block:
            if not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
                raise ValueError(
                    "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
                )
            if not 1 <= self.top_k_experts <= self.num_experts:
                raise ValueError(f"top_k_experts={self.top_k_experts} not in 1..{self.num_experts}")
        return self

    def _check_per_layer_config(self) -> None:
        """Refuse what transformers and mlx-lm would read differently: an override
        of a layer that does not exist, or global_head_dim /
        num_global_key_value_heads set beside it to other values (transformers
        ignores them, mlx-lm reads only them)."""
        assert self.per_layer_config is not None
        for layer in self.per_layer_config:
            if not 0 <= layer < self.num_hidden_layers:
                raise ValueError(
                    f"per_layer_config names layer {layer} of {self.num_hidden_layers}"
                )
        full = [i for i in range(self.num_hidden_layers) if self.is_full(i)]
        for field, key in (
            ("global_head_dim", "head_dim"),
            ("num_global_key_value_heads", "num_key_value_heads"),
        ):
            stated = getattr(self, field)
            if stated is None:
                continue
            for i in full:
                value = getattr(self.per_layer_config.get(i, LayerOverride()), key)
                if value is not None and value != stated:
                    raise ValueError(
                        f"{field}={stated} conflicts with per_layer_config.{i}.{key}={value}; "
                        "make them agree or drop one"
                    )

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def owns_kv(self, layer: int) -> bool:
        return layer < self.first_kv_shared_layer

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V *layer* attends over: itself, or for a KV-shared
        layer the last K/V-owning layer of the same type."""
        if self.owns_kv(layer):
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(self.first_kv_shared_layer) if self.layer_types[i] == kind)

    def is_full(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def layer_head_dim(self, layer: int) -> int:
        if self.per_layer_config is not None:
            override = self.per_layer_config.get(layer, LayerOverride()).head_dim
            return override or self.head_dim
        return (
            self.global_head_dim if self.is_full(layer) and self.global_head_dim else self.head_dim
        )

    def attention_head_dims(self) -> set[int]:
        """Every K/V-owning layer's head dim (the global layers' are wider)."""
        return {self.layer_head_dim(i) for i in range(self.first_kv_shared_layer)}

    def k_eq_v(self, layer: int) -> bool:
        return self.attention_k_eq_v and self.is_full(layer)

    def layer_kv_heads(self, layer: int) -> int:
        if self.per_layer_config is not None:
            override = self.per_layer_config.get(layer, LayerOverride()).num_key_value_heads
            return override or self.num_key_value_heads
        if self.k_eq_v(layer) and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def layer_intermediate_size(self, layer: int) -> int:
        double = self.use_double_wide_mlp and not self.owns_kv(layer)
        return self.intermediate_size * (2 if double else 1)


# -- weights ------------------------------------------------------------------

# Buffers and calibration statistics some exports carry; they are not parameters.
_DROPPED = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min")
# Towers of the multimodal Gemma 4 checkpoints: not part of the text decoder.
_OTHER_TOWERS = (
    "model.vision_tower",
    "model.audio_tower",
    "model.embed_vision",
    "model.embed_audio",
    "model.multi_modal_projector",
    "model.vision_embedder",
)
_SHARED_DROPPED = (".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.k_norm.")


def sanitize(weights: dict[str, mx.array], arch: Gemma4Config) -> dict[str, mx.array]:
    """HF tensor names -> this module's parameter names (pure: returns a new dict).

    - drops rotary buffers and quantisation statistics;
    - drops k/v projections and k_norm of KV-shared layers (checkpoints keep
      them, but those layers never compute K/V);
    - splits the fused ``experts.gate_up_proj`` ``(E, 2I, H)`` into
      ``experts.gate_proj`` and ``experts.up_proj`` ``(E, I, H)`` each;
    - reads mlx-lm's expert names (``experts.switch_glu.<proj>.weight``) as
      ``experts.<proj>``; a packed table's ``scales`` and ``biases`` (under
      either name) become ``experts.<proj>_scales`` and ``_biases``, split like
      the words when fused (quantization runs along the inputs, so rows split alike);
    - reads a multimodal checkpoint's decoder (``model.language_model.*``) and
      drops its vision/audio towers, as mlx-lm's ``gemma4`` does.
    """
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.startswith(_OTHER_TOWERS) or any(part in name for part in _DROPPED):
            continue
        name = name.replace("model.language_model.", "model.", 1)
        if any(part in name for part in _SHARED_DROPPED):
            layer = int(name.split("layers.")[1].split(".")[0])
            if not arch.owns_kv(layer):
                continue
        if ".experts." in name:
            name = _expert_name(name)
        if ".experts.gate_up_proj" in name:
            base, part = name.split(".gate_up_proj")  # part: "" or "_scales" / "_biases"
            gate, up = mx.split(value, 2, axis=-2)  # (E, 2I, H) -> 2 x (E, I, H)
            out[f"{base}.gate_proj{part}"] = mx.contiguous(gate)
            out[f"{base}.up_proj{part}"] = mx.contiguous(up)
            continue
        out[name] = value
    return out


def _expert_name(name: str) -> str:
    """``...experts.switch_glu.gate_proj.weight`` (mlx-lm) -> ``...experts.gate_proj``;
    ``....scales`` / ``.biases`` -> ``...experts.gate_proj_scales`` / ``_biases``."""
    name = name.replace(".experts.switch_glu.", ".experts.", 1).removesuffix(".weight")
    for part in ("scales", "biases"):
        if name.endswith(f"_proj.{part}"):
            return f"{name.removesuffix('.' + part)}_{part}"
    return name


# -- blocks -------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, arch: Gemma4Config, layer: int):
        super().__init__()
        self.head_dim = arch.layer_head_dim(layer)
        self.n_heads = arch.num_attention_heads
        self.n_kv_heads = arch.layer_kv_heads(layer)
        self.owns_kv = arch.owns_kv(layer)
        self.k_eq_v = arch.k_eq_v(layer)
        self.eps = arch.rms_norm_eps
        hidden = arch.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=False)
        if self.owns_kv:
            self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        rope = arch.rope_parameters.get(arch.layer_types[layer], RopeParameters())
        if rope.rope_type == "proportional":
            rotated = int(self.head_dim * rope.partial_rotary_factor)
            self._freqs = rope_freqs(self.head_dim, rope.rope_theta, rotated, rope.factor)
        else:
            self._freqs = rope_freqs(self.head_dim, rope.rope_theta)

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """Queries, keys and values (None where this layer has none) from one
        matmul over the stacked weights, or the modules one by one when sharded."""
        if not self.owns_kv:  # a KV-shared layer: queries only
            return project(self["q_proj"], x), None, None
        names = self._names
        stack = stacked(self, names)
        outs = [project(self[name], x) for name in names] if stack is None else stack(x)
        return outs[0], outs[1], outs[2] if len(outs) == 3 else None

    @property
    def _names(self) -> tuple[str, ...]:
        """The projections of a K/V-owning layer, in their stacked order."""
        return ("q_proj", "k_proj") if self.k_eq_v else ("q_proj", "k_proj", "v_proj")

    def _joint_norm(self) -> mx.array:
        """``(heads [+ kv_heads], 1, D)``: q_norm's weight for each query
        head, then (a K/V-owning layer) k_norm's for each key head, as
        :func:`~turbospark.layers.cuda.heads.norm_rope_ops` scales them
        (evaluated once, kept in ``__dict__``, rebuilt when a weight was replaced)."""
        q_w = self["q_norm"]["weight"]
        k_w = self["k_norm"]["weight"] if self.owns_kv else None
        held = self.__dict__.get("_joint")
        if held is not None and held[0] is q_w and held[1] is k_w:
            return held[2]
        shape = (self.head_dim,)
        parts = [mx.broadcast_to(q_w, (self.n_heads, *shape))]
        if k_w is not None:
            parts.append(mx.broadcast_to(k_w, (self.n_kv_heads, *shape)))
        joint = mx.concatenate(parts)[:, None, :]  # (heads [+ kv_heads], 1, D)
        mx.eval(joint)
        self.__dict__["_joint"] = (q_w, k_w, joint)
        return joint

    def __call__(
        self,
        x: mx.array,
        start: int | mx.array,
        kv: LayerKV | BatchLayerKV | None,
        shared: Attended | None,
    ) -> tuple[mx.array, Attended]:
        """The attention output ``(B, L, hidden)`` and what it attended. *start*
        is the RoPE offset: a Python int, or (compiled steps) a device array,
        so that one trace serves every position."""
        batch, length, _ = x.shape
        joint = self.owns_kv and runs_compiled(batch, length)
        stack = stacked(self, self._names) if joint else None
        if stack is not None:  # a step or a verify pass: q, k and v normed together
            queries, keys, values = joint_inputs_step(
                matmul_t(x, stack.weight_t), self._joint_norm(), start, self["_freqs"], self.n_heads,
                self.n_kv_heads, self.eps,
            )  # fmt: skip
        else:
            q, k, v = self._project(x)
            norms = (self["q_norm"]["weight"], self["k_norm"]["weight"] if self.owns_kv else None)
            inputs = attention_inputs_step if runs_compiled(batch, length) else attention_inputs
            queries, keys, values = inputs(
                q, k, v, norms, start, self["_freqs"], self.n_heads, self.n_kv_heads,
                self.head_dim, self.eps,
            )  # fmt: skip
        if self.owns_kv:
            out, attended = cached_attention(queries, keys, values, kv, scale=1.0)
        else:
            attended = shared
            out = shared_attention(queries, shared, scale=1.0)
        return project(self["o_proj"], merge_heads(out)), attended


def attention_inputs(
    q: mx.array,
    k: mx.array | None,
    v: mx.array | None,
    norms: tuple[mx.array, mx.array | None],
    start: int | mx.array,
    freqs: mx.array,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Projections ``(B, L, n*D)`` -> normed, rotated queries and keys and
    normed values, each ``(B, n, L, D)`` (None for a KV-shared layer's keys and
    values; *v* None with *k* given: ``attention_k_eq_v``, values are the raw
    key projection, before k_norm and RoPE). Exactly the modules' ops
    (``nn.RMSNorm`` is ``mx.fast.rms_norm``), over arrays so it compiles."""
    q_norm, k_norm = norms
    queries = apply_rope(normed_heads(q, heads, q_norm, eps), start, head_dim, freqs)
    if k is None:
        return queries, None, None
    keys = apply_rope(normed_heads(k, kv_heads, k_norm, eps), start, head_dim, freqs)
    values = normed_heads(k if v is None else v, kv_heads, None, eps)  # no scale
    return queries, keys, values


# Traced once per batch size and short lone-row length, with the RoPE offset a
# device array (runs_compiled); prefill runs it uncompiled.
attention_inputs_step = mx.compile(attention_inputs)


# A K/V-owning layer's q, k and v normed together in its compiled forwards (a
# decode step, a lone row's verify pass: runs_compiled), traced once per batch
# size and short lone-row length.
joint_inputs_step = mx.compile(norm_rope_ops)


class Router(nn.Module):
    """Scale-normed input -> expert scores -> top-k, softmax over the chosen k,
    times a learned per-expert scale."""

    def __init__(self, arch: Gemma4Config):
        super().__init__()
        self.top_k = arch.top_k_experts
        self.eps = arch.rms_norm_eps
        self.root_size = arch.hidden_size**-0.5
        self.proj = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.scale = mx.ones((arch.hidden_size,))
        self.per_expert_scale = mx.ones((arch.num_experts,))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        scores = self.proj(mx.fast.rms_norm(x, self.scale * self.root_size, self.eps))  # (N, E)
        chosen = mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k :]  # (N, k)
        weights = mx.softmax(mx.take_along_axis(scores, chosen, axis=-1), axis=-1)
        return chosen, weights * self.per_expert_scale[chosen]


class Experts(ExpertLayer):
    """GeGLU experts as stacked ``(E, out, in)`` matrices, applied with ``gather_mm``
    (resident, or streamed into slots: :class:`turbospark.layers.experts.ExpertLayer`)."""

    def __init__(self, arch: Gemma4Config):
        inner, hidden = arch.moe_intermediate_size, arch.hidden_size
        super().__init__(arch.num_experts, expert_shapes(inner, hidden))
        self.group: mx.distributed.Group | None = None  # set by shard(): sum the partial outputs

    def shard(self, group: mx.distributed.Group) -> None:
        """Each rank keeps a slice of every expert's inner width; the weighted
        expert sum is linear in the down projection, so one ``all_sum`` of the
        partial outputs is the whole result."""
        shard_experts(self, group, into=("gate_proj", "up_proj"), out_of=("down_proj",))
        self.group = group

    def __call__(
        self, x: mx.array, chosen: mx.array, weights: mx.array, dense: mx.array
    ) -> mx.array:
        """The weighted sum of each token's experts; *dense* (the MLP beside
        them) only starts computing while streamed experts are read."""
        # (N, H) -> (N, 1, 1, H): batch dims (N, 1) broadcast against the (N, k) indices.
        x = x[:, None, None, :]

        def geglu_experts(w: dict[str, ExpertTable], idx: mx.array) -> mx.array:
            gate = gather_experts(x, w["gate_proj"], idx)  # (N, k, 1, I)
            up = gather_experts(x, w["up_proj"], idx)
            return gather_experts(geglu(gate, up), w["down_proj"], idx)

        y = self.routed(chosen, geglu_experts, overlap=[dense])
        y = y.squeeze(-2)  # (N, k, 1, H) -> (N, k, H)
        out = (weights[..., None] * y).sum(axis=-2)
        return out if self.group is None else mx.distributed.all_sum(out, group=self.group)


def expert_shapes(inner: int, hidden: int) -> dict[str, tuple[int, int]]:
    """One expert's ``(out, in)`` per projection, after ``sanitize`` splits gate_up."""
    return {"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}


def moe_spec(arch: Gemma4Config) -> MoESpec | None:
    """Where each layer's experts live in an install: a fused ``gate_up_proj``
    ``(E, 2I, H)`` (the release layout; gate is the first half of axis 1, as
    ``sanitize`` splits it) or split ``gate_proj``/``up_proj``, under ``model.``
    or a multimodal release's ``model.language_model.``, or mlx-lm's
    ``switch_glu.<proj>.weight`` (packed or not: the cache finds the scales
    and biases beside a packed tensor)."""
    if not arch.enable_moe_block:
        return None
    inner = arch.moe_intermediate_size
    shapes = expert_shapes(inner, arch.hidden_size)
    fused = {"gate_proj": (0, inner), "up_proj": (inner, 2 * inner)}
    layers = {}
    for i in range(arch.num_hidden_layers):
        prefixes = [f"model.layers.{i}.experts", f"model.language_model.layers.{i}.experts"]
        layer = {}
        for name, shape in shapes.items():
            sources = [ExpertSlice(tensor=f"{p}.{name}") for p in prefixes] + [
                ExpertSlice(tensor=f"{p}.switch_glu.{name}.weight") for p in prefixes
            ]
            if name in fused:
                sources = [
                    ExpertSlice(tensor=f"{p}.gate_up_proj", rows=fused[name]) for p in prefixes
                ] + sources
            layer[name] = ExpertProjection(shape=shape, sources=sources)
        layers[f"model.layers.{i}.experts"] = layer
    return MoESpec(num_experts=arch.num_experts, top_k=arch.top_k_experts, layers=layers)


class DecoderLayer(nn.Module):
    def __init__(self, arch: Gemma4Config, layer: int):
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.self_attn = Attention(arch, layer)
        self.mlp = GatedMLP(hidden, arch.layer_intermediate_size(layer), combine=geglu)
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.moe = arch.enable_moe_block
        if self.moe:
            self.router = Router(arch)
            self.experts = Experts(arch)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(hidden, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(hidden, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(hidden, eps=eps)
        self.ple = arch.hidden_size_per_layer_input > 0
        if self.ple:
            self.per_layer_input_gate = nn.Linear(
                hidden, arch.hidden_size_per_layer_input, bias=False
            )
            self.per_layer_projection = nn.Linear(
                arch.hidden_size_per_layer_input, hidden, bias=False
            )
            self.post_per_layer_input_norm = nn.RMSNorm(hidden, eps=eps)
        self.layer_scalar = mx.ones((1,))
        self.eps = eps
        # After attention: norms on both sides of attention and of the GeGLU
        # MLP, the per-layer input block (PLE) as a side input, the layer scalar.
        ple = ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")
        self.end = LayerEnd(
            "pre_feedforward_layernorm", eps, gelu=True,
            post_mixer="post_attention_layernorm", post_mlp="post_feedforward_layernorm",
            side=ple if self.ple else None, scale="layer_scalar",
        )  # fmt: skip

    def __call__(
        self,
        h: mx.array | Unjoined,
        start: int | mx.array,
        kv: LayerKV | BatchLayerKV | None,
        shared: Attended | None,
        per_layer_input: mx.array | None,
        join: Join | None = None,
    ) -> tuple[mx.array | Unjoined, Attended]:
        """The layer's output and what it attended; with *join* (steering, see
        :func:`turbospark.policies.steering.joiner`) the last residual join is handed to it.
        *h* may come unjoined (:class:`~turbospark.layers.cuda.norm.Unjoined`):
        the input norm then makes the last layer's join in the same kernel."""
        if join is None and not self.moe and h.shape[:2] == (1, 1) and kernels_available():
            stepped = self._layer_step(h, start, kv, shared, per_layer_input)
            if stepped is not None:
                return stepped
        # Modules and arrays by item (a module is a dict): nn.Module.__getattr__
        # is a Python call, and this runs for every layer and step.
        h, normed = normed_input(h, self["input_layernorm"]["weight"], self.eps)
        attn, attended = self["self_attn"](normed, start, kv, shared)
        if not self.moe:
            return self.end(self, h, attn, per_layer_input, join), attended
        h = h + self.post_attention_layernorm(attn)
        # Dense MLP and expert block side by side, both reading the same residual.
        dense = self.post_feedforward_layernorm_1(self["mlp"](self.pre_feedforward_layernorm(h)))
        tokens = h.reshape(-1, h.shape[-1])  # (B*L, H): routing is per token
        chosen, weights = self.router(tokens)
        sparse = self.experts(self.pre_feedforward_layernorm_2(tokens), chosen, weights, dense)
        sparse = sparse.reshape(h.shape)
        ff = self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(sparse))
        return self.end.finish(self, h, ff, per_layer_input, join), attended

    def _layer_step(
        self,
        h: mx.array | Unjoined,
        start: mx.array,
        kv: LayerKV | BatchLayerKV | None,
        shared: Attended | None,
        per_layer_input: mx.array | None,
    ) -> tuple[mx.array | Unjoined, Attended] | None:
        """A lone row's decode step where attention takes the CUDA kernels,
        each layer one traced call (:data:`ATTENTION_STEP`): a K/V-owning
        layer's writes its new key and value into the cache's buffers, a
        KV-shared layer's writes nothing. None where the step does not take
        this path, with nothing changed: the caller runs the modules."""
        attn = self["self_attn"]
        heads, kv_heads = attn.n_heads, attn.n_kv_heads
        return ATTENTION_STEP(
            self, self.end, h, start, (heads, kv_heads, attn.head_dim),
            (heads, kv_heads if attn.owns_kv else 0, self.eps), kv=kv, shared=shared,
            side_input=per_layer_input,
        )  # fmt: skip


def step_weights(attn: Attention) -> tuple[WeightT | mx.array, ...] | None:
    """What a layer step's attention reads: the projections before it
    (stacked for a K/V-owning layer, the query's alone for a KV-shared one)
    transposed or packed (:func:`transposed`), their norm weights
    (``Attention._joint_norm``), RoPE's frequencies and the output projection
    alike; None where a projection is sharded."""
    o_proj = attn["o_proj"]
    if not readable(o_proj):
        return None
    if attn.owns_kv:
        stack = stacked(attn, attn._names)
        if stack is None:
            return None
        projections_t = stack.weight_t
    else:
        q_proj = attn["q_proj"]
        if not readable(q_proj):
            return None
        projections_t = transposed(q_proj)
    return projections_t, attn._joint_norm(), attn["_freqs"], transposed(o_proj)


def step_paths(attn: Attention) -> list[tuple[str, ...]]:
    """The paths from the attention module to each parameter :func:`step_weights` reads."""
    names = ("q_proj", "o_proj", "q_norm")
    names += (*attn._names[1:], "k_norm") if attn.owns_kv else ()
    return [*((name, "weight") for name in names), ("_freqs",)]


def step_inputs(
    projected: mx.array,
    reads: tuple[mx.array, mx.array],
    start: mx.array,
    heads: int,
    kv_heads: int,
    eps: float,
) -> tuple[mx.array | None, ...]:
    """A step's heads from its projected row ``(1, width)``: q (and, where
    the layer owns its K/V, k and v) normed and rotated together
    (:func:`~turbospark.layers.cuda.heads.norm_rope`; *kv_heads* 0: queries
    alone); no output gate."""
    joint_norm, freqs = reads
    queries, *kv = norm_rope(projected, joint_norm, start, freqs, heads, kv_heads, eps)
    keys, values = kv or (None, None)
    return queries, keys, values, None


# A layer's decode step as one trace: q/k/v normed and rotated together, the
# values normed without a scale, K/V shared by the last layers.
ATTENTION_STEP = AttentionStep(step_inputs, step_weights, step_paths)


@partial(mx.compile, shapeless=True)
def ple_mix(proj: mx.array, table: mx.array, table_scale: float) -> mx.array:
    """``(proj + table * table_scale) * 2**-0.5``: the per-layer inputs'
    last mix, one kernel (three uncompiled)."""
    return (proj + table * table_scale) * 2.0**-0.5


def _last_query(attended: Attended) -> Attended:
    """The attended keys/values with the mask of the last query row only."""
    keys, values, mask = attended
    if isinstance(mask, mx.array):
        return keys, values, mask[..., -1:, :]
    return keys, values, None  # "causal" or None: the last row sees every key


class Gemma4TextModel(nn.Module):
    """Embeddings, the layer stack and the final norm (HF prefix ``model.``)."""

    def __init__(self, arch: Gemma4Config):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = [DecoderLayer(arch, i) for i in range(arch.num_hidden_layers)]
        self.norm = nn.RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.ple_dim = arch.hidden_size_per_layer_input
        if self.ple_dim:
            n = arch.num_hidden_layers
            self.embed_tokens_per_layer = nn.Embedding(
                arch.vocab_size_per_layer_input, n * self.ple_dim
            )
            self.per_layer_model_projection = nn.Linear(
                arch.hidden_size, n * self.ple_dim, bias=False
            )
            self.per_layer_projection_norm = nn.RMSNorm(self.ple_dim, eps=arch.rms_norm_eps)
        slots = kv_slots(arch)
        # Per layer, decided once: its K/V slot (None: KV-shared) and the layer
        # whose K/V it attends over. In the instance's __dict__, not through
        # Module.__setattr__ (which would hold a list as a child module).
        self.__dict__["_plan"] = [
            (slots.get(i), arch.kv_source(i)) for i in range(arch.num_hidden_layers)
        ]

    def _per_layer_inputs(self, tokens: mx.array, h: mx.array) -> list[mx.array]:
        """Each layer's ``(B, L, ple_dim)``: a per-layer token embedding mixed
        with a projection of the (scaled) input embedding. Taken apart by one
        split (one graph node for every layer), where indexing each layer's
        out of the whole costs a slice and a squeeze a layer, and a Python
        index's host time (about 3 µs each)."""
        arch, n, shape = self.arch, self.arch.num_hidden_layers, tokens.shape
        ids = tokens
        if arch.vocab_size > arch.vocab_size_per_layer_input:
            # Ids past the PLE table (multimodal placeholders) read row 0, as in HF;
            # when the table covers the vocabulary no id is past it.
            ids = mx.where(tokens < arch.vocab_size_per_layer_input, tokens, 0)
        # The module, not its weight: a quantized table dequantizes the rows it gathers.
        table = self["embed_tokens_per_layer"](ids)
        table = table.reshape(*shape, n, self.ple_dim)  # (B, L, n*P) -> (B, L, n, P)
        proj = project(self["per_layer_model_projection"], h).reshape(*shape, n, self.ple_dim)
        # The projection's scale hidden**-0.5 goes into the norm's eps instead
        # (RMSNorm(c x, eps) = RMSNorm(x, eps / c**2)): one kernel fewer.
        norm = self["per_layer_projection_norm"]
        proj = mx.fast.rms_norm(proj, norm["weight"], norm.eps * arch.hidden_size)
        mixed = ple_mix(proj, table, self.ple_dim**0.5)  # (B, L, n, P)
        return mx.split(mixed.reshape(*shape, n * self.ple_dim), n, axis=-1)  # n x (B, L, P)

    def __call__(
        self,
        tokens: mx.array,
        start: int | mx.array,
        state: State,
        vision: VisionMap | None,
        last_only: bool = False,
        steer: LayerHook | None = None,
    ) -> mx.array:
        """Final-normed hidden states ``(B, L, hidden)`` for ``tokens`` ``(B, L)``, row
        ``i`` from position ``start`` (an int for one session, ``(B,)`` for a batch);
        with *last_only*, ``(B, 1, hidden)`` for the last token, and the KV-shared
        tail layers (which write no state) run for that token alone. *steer*
        sees each layer's output (after the PLE and layer scalar); None adds no op."""
        embeddings = self.embed_tokens(tokens)  # (B, L, H)
        if vision is not None:  # one session: the map covers its prompt
            # Image features replace the raw (unscaled) rows, as mlx-lm's input_embeddings.
            assert isinstance(start, int)
            embeddings = vision.inject(embeddings[0], start)[None]
        h = embeddings * self.arch.hidden_size**0.5
        per_layer = self._per_layer_inputs(tokens, h) if self.ple_dim else None
        if isinstance(start, int):
            # RoPE's offset as a device array: the compiled attention inputs trace once
            # for every position (a Python int would be a constant of the trace).
            start = mx.array(start, dtype=mx.int32)

        attended: list[Attended | None] = [None] * len(self.layers)
        for i, (layer, (slot, source)) in enumerate(zip(self.layers, self._plan, strict=True)):
            if slot is None and last_only and h.shape[1] > 1:
                # The first KV-shared layer: every later one is shared too (they form
                # the tail), so from here on only the last token is ever read.
                skip = h.shape[1] - 1
                h, start = h.last() if isinstance(h, Unjoined) else h[:, -1:], start + skip
                if per_layer is not None:
                    per_layer = [*per_layer[:i], *(x[:, -1:] for x in per_layer[i:])]
                attended = [None if a is None else _last_query(a) for a in attended]
            kv = state[slot[0]][slot[1]] if slot else None
            shared = None if slot else attended[source]
            layer_input = per_layer[i] if per_layer is not None else None
            h, attended[i] = layer(h, start, kv, shared, layer_input, joiner(steer, i))
        # Once per call, whether or not this arch has layers of that kind.
        for spec in COMPONENTS:
            state[spec.name].advance(tokens.shape[1])
        return normed_input(h, self["norm"]["weight"], self.arch.rms_norm_eps)[1]


class Gemma4(nn.Module):
    """The decoder plus its head; parameter names are the HF checkpoint's."""

    def __init__(self, arch: Gemma4Config):
        super().__init__()
        self.arch = arch
        self.model = Gemma4TextModel(arch)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def __call__(
        self,
        tokens: mx.array,
        start: int | mx.array,
        state: State,
        vision: VisionMap | None,
        last_only: bool = False,
        steer: LayerHook | None = None,
    ) -> mx.array:
        """Final-normed hidden states for ``tokens`` ``(B, L)`` (see the text model)."""
        return self.model(tokens, start, state, vision, last_only, steer)

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallelism across *group* (:mod:`turbospark.layers.sharding`): every
        layer's heads, MLP width and expert width split; embeddings, PLE, router,
        norms and the head stay whole. KV-shared layers own no K/V projections."""
        arch = self.arch
        for i in range(arch.num_hidden_layers):  # every check before any weight moves
            kv_copies(group, arch.num_attention_heads, arch.layer_kv_heads(i))
            require_divisible(group, intermediate_size=arch.layer_intermediate_size(i))
        if arch.enable_moe_block:
            require_divisible(group, moe_intermediate_size=arch.moe_intermediate_size)
        for i, layer in enumerate(self.model.layers):  # quantized: whole groups on each rank
            outs = {
                "self_attn.o_proj": layer.self_attn.o_proj,
                "mlp.down_proj": layer.mlp.down_proj,
            }
            if layer.moe:
                outs["experts.down_proj"] = layer.experts.tables()["down_proj"]
            require_whole_groups(group, **{f"model.layers.{i}.{k}": v for k, v in outs.items()})
        for layer in self.model.layers:
            attn = layer.self_attn
            owned = ("k_proj",) if attn.k_eq_v else ("k_proj", "v_proj")
            attn.n_heads, attn.n_kv_heads = shard_attention(
                attn,
                group,
                heads=attn.n_heads,
                kv_heads=attn.n_kv_heads,
                kv_projections=owned if attn.owns_kv else (),
            )
            shard_mlp(layer.mlp, group)
            if layer.moe:
                layer.experts.shard(group)

    def head(self, hidden: mx.array) -> mx.array:
        """``(L, hidden)`` -> softcapped logits ``(L, vocab)``."""
        if self.arch.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(hidden)
        else:
            logits = self.lm_head(hidden)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else softcap(logits, cap)
