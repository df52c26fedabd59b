"""The Qwen3.5 dense hybrid text model, computed exactly as mlx-lm's ``qwen3_5`` does.

A stack of pre-norm residual layers; ``layer_types`` (or, without it, every
``full_attention_interval``-th layer, 1-based) says which are gated full
attention, the others are gated DeltaNet linear attention (:mod:`turbospark.layers.gated_delta`):

- linear: ``in_proj_qkv`` -> depthwise causal conv (K taps, continuing from
  the session's conv tail) -> SiLU -> l2-normalised q/k -> gated delta rule
  (decay from ``A_log``/``dt_bias``/``in_proj_a``, step size from
  ``in_proj_b``) -> RMSNorm gated by ``silu(in_proj_z x)`` -> ``out_proj``;
- full: ``q_proj`` emits queries *and* an output gate (twice the width),
  RMSNorm on q and k per head, partial RoPE on the first
  ``head_dim * partial_rotary_factor`` dims, and ``o_proj(attn * sigmoid(gate))``.

Multimodal RoPE: with a vision map the full layers rotate by per-token
(t, h, w) positions; Qwen3.5 interleaves the three over the rotated
frequencies (``mrope_section``). For text the three are equal and this is
plain RoPE, which is what mlx-lm (text only) computes.

Shapes: hidden states are ``(B, L, hidden)``: one session is ``B = 1``, a
decode batch stacks several sessions, each at its own position (``offset`` is
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
    AttentionStep,
    BatchKV,
    BatchLayerKV,
    GatedDeltaNet,
    GatedMLP,
    GDNComponent,
    GDNDims,
    Join,
    KVComponent,
    LayerEnd,
    LayerHook,
    LayerKV,
    State,
    Unjoined,
    VisionMap,
    WeightT,
    cached_attention,
    derived,
    gated_delta_layer_step,
    heads_first,
    joiner,
    kv_copies,
    merge_heads,
    normed_heads,
    normed_input,
    project,
    readable,
    require_divisible,
    runs_compiled,
    shard_attention,
    shard_gated_delta,
    shard_mlp,
    sigmoid_gate,
    stacked,
    transposed,
)


class RopeParameters(BaseModel):
    """``rope_parameters`` as Qwen3.5 checkpoints write it (defaults are mlx-lm's)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rope_type: Literal["default", "mrope"] = "default"
    rope_theta: float = 100000.0
    partial_rotary_factor: float = Field(0.25, gt=0.0, le=1.0)
    # Frequencies per (t, h, w) axis, meant to sum to the rotated dims / 2 (HF
    # does not check, so neither do we: t takes whatever h and w do not). Qwen3.5
    # always interleaves them (HF ignores ``mrope_interleaved``), so we do too.
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @model_validator(mode="before")
    @classmethod
    def _type_alias(cls, data: Any) -> Any:
        # mlx-lm accepts the older "type" key for "rope_type".
        if isinstance(data, dict) and "type" in data and "rope_type" not in data:
            data = {**data, "rope_type": data["type"]}
        return data


LayerType = Literal["linear_attention", "full_attention"]


class QwenGdnConfig(ArchConfig):
    """``config.json`` of a Qwen3.5 text decoder (HF key names, mlx-lm's defaults).

    Release checkpoints nest it under ``text_config`` (``qwen3_5_text``) beside a
    vision tower; core's config reader hands this class the decoder's part.
    """

    model_type: Literal["qwen3_5", "qwen3_5_text"] = "qwen3_5"
    intermediate_size: int = Field(14336, gt=0)
    num_attention_heads: int = Field(32, gt=0)
    num_key_value_heads: int = Field(8, gt=0)
    # None in config.json means hidden_size // num_attention_heads (filled in below).
    head_dim: int = Field(0, ge=0)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    linear_num_value_heads: int = Field(64, gt=0)
    linear_num_key_heads: int = Field(16, gt=0)
    linear_key_head_dim: int = Field(192, gt=0)
    linear_value_head_dim: int = Field(128, gt=0)
    linear_conv_kernel_dim: int = Field(4, ge=2)
    # Layer i is full attention when (i + 1) % full_attention_interval == 0; only
    # read when config.json has no layer_types (transformers writes only those).
    # None: not in config.json, so 4 (mlx-lm's default) when it decides.
    full_attention_interval: int | None = Field(None, gt=0)
    layer_types: list[LayerType] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Layers of the multi-token-prediction head (``mtp.*``). Release checkpoints
    # say 1 even where the export dropped the weights (mlx-community), so the
    # head is built from the weights present, not from this (plugin.py).
    mtp_num_hidden_layers: int = Field(0, ge=0)
    rope_parameters: RopeParameters = Field(default_factory=RopeParameters)

    @model_validator(mode="before")
    @classmethod
    def _default_head_dim(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("head_dim") and "hidden_size" in data:
            heads = data.get("num_attention_heads", cls.model_fields["num_attention_heads"].default)
            data = {**data, "head_dim": data["hidden_size"] // heads}
        return data

    @model_validator(mode="after")
    def _check(self) -> QwenGdnConfig:
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        interval = self.full_attention_interval or 4
        by_interval = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(self.num_hidden_layers)
        ]
        if self.layer_types is None:
            # Frozen model: set the derived default once, here, before anyone reads it.
            object.__setattr__(self, "layer_types", by_interval)
        elif len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        elif self.full_attention_interval is not None and self.layer_types != by_interval:
            # transformers reads layer_types, mlx-lm the interval: they would build different models.
            raise ValueError(
                f"layer_types conflicts with full_attention_interval={interval}; "
                "make them agree or drop full_attention_interval"
            )
        return self

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rope_parameters.partial_rotary_factor)

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"


# -- weights ------------------------------------------------------------------

# RMSNorms that Qwen3.5 stores zero-centred (the model computes ``1 + w``); the
# gated norm inside the linear layers is not one of them.
_SHIFTED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.norm.weight",
    ".pre_fc_norm_embedding.weight",
    ".pre_fc_norm_hidden.weight",
)


def _text_name(name: str) -> str | None:
    """A checkpoint name -> this module's name; None for vision-tower tensors."""
    if name.startswith(("vision_tower", "model.visual")):
        return None
    if name.startswith("model.language_model."):  # HF multimodal checkpoint
        return "model." + name.removeprefix("model.language_model.")
    return name.removeprefix("language_model.")  # mlx-community exports; HF text-only as is


def sanitize(weights: dict[str, mx.array], arch: QwenGdnConfig) -> dict[str, mx.array]:
    """Checkpoint tensors -> this module's parameters (pure: returns a new dict).

    Mirrors mlx-lm's ``qwen3_5`` sanitize, except that the multi-token-prediction
    head (``mtp.*``, which mlx-lm drops) is kept for ``DraftPolicies.mtp``
    (:mod:`turbospark_qwen_gdn.mtp`; its RMSNorms are zero-centred like the
    rest): drops the vision tower, drops ``lm_head`` when embeddings are tied, and — only for an HF-layout checkpoint, recognised by a conv1d
    weight stored ``(C, 1, K)`` — moves the conv to mlx's ``(C, K, 1)`` and
    shifts the zero-centred RMSNorm weights by +1. An mlx-converted checkpoint
    has both done already and passes through unchanged.
    """
    hf_layout = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        target = _text_name(name)
        if target is None:
            continue
        if arch.tie_word_embeddings and target == "lm_head.weight":
            continue
        if "conv1d.weight" in target and value.shape[-1] != 1:
            value = mx.moveaxis(value, 2, 1)  # (C, 1, K) -> (C, K, 1)
        if hf_layout and value.ndim == 1 and target.endswith(_SHIFTED_NORMS):
            value = value + 1.0
        out[target] = value
    return out


# -- rope -----------------------------------------------------------------------


class QwenRope:
    """Partial RoPE (non-traditional halves) on the first ``rotary_dims`` of each head."""

    def __init__(self, arch: QwenGdnConfig):
        self.dims = arch.rotary_dims
        self.base = arch.rope_parameters.rope_theta
        half = self.dims // 2
        index = mx.arange(half)
        t_sec, h_sec, w_sec = arch.rope_parameters.mrope_section
        del t_sec  # t takes every frequency that h and w do not
        # Interleaved layout: frequency j reads h when j % 3 == 1 (j < 3*h_sec),
        # w when j % 3 == 2 (j < 3*w_sec), t otherwise (HF's recomposition).
        self.axis = mx.where(
            (index % 3 == 1) & (index < 3 * h_sec),
            1,
            mx.where((index % 3 == 2) & (index < 3 * w_sec), 2, 0),
        )  # (half,)
        self.inv_freq = self.base ** (-mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims)

    def __call__(self, x: mx.array, offset: int | mx.array, positions: mx.array | None) -> mx.array:
        """Rotate ``(B, heads, L, head_dim)`` from ``offset`` (an int, or one per row);
        ``positions`` is ``(3, L)`` (t, h, w) for a one-row vision prompt, or None."""
        if positions is None:
            return mx.fast.rope(
                x, self.dims, traditional=False, base=self.base, scale=1.0, offset=offset
            )
        per_freq = positions[self.axis].T.astype(mx.float32)  # (L, half): each freq's position
        angles = per_freq * self.inv_freq
        cos, sin = mx.cos(angles), mx.sin(angles)
        half = self.dims // 2
        x1, x2, rest = x[..., :half], x[..., half : self.dims], x[..., self.dims :]
        rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest]
        return mx.concatenate(rotated, axis=-1).astype(x.dtype)


# -- blocks -------------------------------------------------------------------


class GatedAttention(nn.Module):
    def __init__(self, arch: QwenGdnConfig):
        super().__init__()
        heads, kv_heads, dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim
        self.scale = dim**-0.5
        bias = arch.attention_bias
        self.q_proj = nn.Linear(arch.hidden_size, heads * dim * 2, bias=bias)  # queries + gate
        self.k_proj = nn.Linear(arch.hidden_size, kv_heads * dim, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, kv_heads * dim, bias=bias)
        self.o_proj = nn.Linear(heads * dim, arch.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(dim, eps=arch.rms_norm_eps)
        self.k_norm = nn.RMSNorm(dim, eps=arch.rms_norm_eps)

    def __call__(
        self,
        x: mx.array,
        kv: LayerKV | BatchLayerKV,
        rope: QwenRope,
        offset: int | mx.array,
        positions: mx.array | None,
        residual: mx.array | None = None,
    ) -> mx.array:
        """The attention output, plus *residual* when given (added by ``o_proj``'s GEMM)."""
        batch, length, _ = x.shape
        qkv = stacked(self, ("q_proj", "k_proj", "v_proj"))  # one matmul (unless sharded)
        if qkv is None:
            q, k, v = (project(self[name], x) for name in ("q_proj", "k_proj", "v_proj"))
        else:
            q, k, v = qkv(x)
        norms = (scaled_query_norm(self), self["k_norm"]["weight"])
        dims = (self.heads, self.kv_heads, self["q_norm"].eps)
        if positions is None and runs_compiled(batch, length):
            # One trace for every position: the offset is a device array (a caller's
            # Python int would be a constant of the trace, one per position).
            if isinstance(offset, int):
                offset = mx.array(offset, dtype=mx.int32)
            queries, keys, values, gate = attention_inputs_step(
                q, k, v, norms, offset, dims, rope.dims, rope.base
            )
        else:
            queries, keys, values, gate = attention_inputs(q, k, v, norms, None, dims)
            queries = rope(queries, offset, positions)
            keys = rope(keys, offset, positions)
        out, _ = cached_attention(queries, keys, values, kv, 1.0)  # the scale is q_norm's
        # Gated in the heads layout: the gate is a strided half of q's heads, read
        # in place by the fused kernel, where flattening it first would copy it.
        return project(self["o_proj"], merge_heads(sigmoid_gate(out, gate)), residual)


def scaled_query_norm(attention: GatedAttention) -> mx.array:
    """``q_norm``'s weight times the attention scale ``head_dim**-0.5``, so the
    normed queries come out scaled and the attention takes a scale of 1: no
    multiply kernel a layer and token (RoPE is linear, so scaling before it
    is the same). Built once per weight (:func:`derived`)."""
    return derived(
        attention,
        "_scaled_query_norm",
        attention["q_norm"]["weight"],
        lambda w: w * attention.scale,
    )


def attention_inputs(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    norms: tuple[mx.array, mx.array],
    offset: mx.array | None,
    dims: tuple[int, int, float],
    rotary_dims: int = 0,
    base: float = 0.0,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Projections ``(B, L, n * dim)`` (*dims*: the query and key/value head
    counts and the norms' eps) -> normed queries and keys, values (each ``(B, n, L, dim)``)
    and the output gate ``(B, heads, L, dim)``; rotated from *offset* with
    plain RoPE (text) when it is given, else the caller rotates (a vision
    prompt's per-token positions). Exactly the modules' ops (``nn.RMSNorm`` is
    ``mx.fast.rms_norm``, :class:`QwenRope` without positions is
    ``mx.fast.rope``), over arrays so it compiles."""
    heads, kv_heads, eps = dims
    # (B, L, heads * 2 * dim) -> queries and gate, each (B, heads, L, dim)
    queries, gate = mx.split(heads_first(q, heads), 2, axis=-1)
    q_norm, k_norm = norms
    queries = mx.fast.rms_norm(queries, q_norm, eps)
    keys = normed_heads(k, kv_heads, k_norm, eps)
    values = heads_first(v, kv_heads)
    if offset is not None:
        rotate = partial(
            mx.fast.rope, dims=rotary_dims, traditional=False, base=base, scale=1.0, offset=offset
        )
        queries, keys = rotate(queries), rotate(keys)
    return queries, keys, values, gate


# Traced once per batch size and short lone-row length (runs_compiled), with
# the RoPE offset a device array; prefill runs it uncompiled and rotates apart.
attention_inputs_step = mx.compile(attention_inputs)


class DecoderLayer(nn.Module):
    def __init__(self, arch: QwenGdnConfig, layer: int, slot: int, full: bool = False):
        """Layer *layer* of the stack (its kind from ``layer_types``), or with
        *full* a gated full-attention layer whatever the index (the MTP head's)."""
        super().__init__()
        self.is_linear = not full and arch.is_linear(layer)
        self.slot = slot  # index of this layer inside its state component
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(GDNDims.of(arch))
        else:
            self.self_attn = GatedAttention(arch)
        self.input_layernorm = nn.RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size)
        self.eps = arch.rms_norm_eps  # the layer's RMS norms' (a layer step passes it to its trace)
        # Pre-norm: the SwiGLU MLP after its norm, both residual joins plain adds.
        self.end = LayerEnd("post_attention_layernorm", arch.rms_norm_eps)

    def __call__(
        self,
        x: mx.array | Unjoined,
        kv: KVComponent | BatchKV,
        gdn: GDNComponent,
        rope: QwenRope,
        offset: int | mx.array,
        positions: mx.array | None,
        join: Join | None = None,
    ) -> mx.array | Unjoined:
        """The layer's output; with *join* (steering, see
        :func:`turbospark.policies.steering.joiner`) its last residual add is handed to it.
        *x* may come unjoined (:class:`~turbospark.layers.cuda.norm.Unjoined`):
        the input norm then makes the last layer's join in the same kernel."""
        if join is None and positions is None and x.shape[:2] == (1, 1):
            stepped = self._layer_step(x, kv, gdn, rope, offset)
            if stepped is not None:
                return stepped
        # Modules and arrays by item (a module is a dict): nn.Module.__getattr__
        # is a Python call, and this runs for every layer and step.
        norm = self["input_layernorm"]
        x, normed = normed_input(x, norm["weight"], norm.eps)
        # The residual join after the mixer: the layer's end makes it with the
        # norm kernels, else the mixer's output projection's GEMM adds it.
        residual = None if self.end.joins_mixer(self, join) else x
        if self.is_linear:
            h = self["linear_attn"](normed, gdn, self.slot, residual=residual)
        else:
            h = self["self_attn"](normed, kv[self.slot], rope, offset, positions, residual=residual)
        if residual is None:
            return self.end(self, x, h, join=join)
        return self.end(self, h, None, join=join)

    def _layer_step(
        self,
        x: mx.array | Unjoined,
        kv: KVComponent | BatchKV,
        gdn: GDNComponent | None,
        rope: QwenRope,
        offset: int | mx.array,
    ) -> mx.array | Unjoined | None:
        """A lone row's decode step as one traced call, where the layer's CUDA
        kernels run: a gated-DeltaNet layer's (:func:`gated_delta_layer_step`), a
        full-attention layer's (:data:`GATED_ATTENTION_STEP`). None where the
        step does not take this path, with nothing changed: the caller runs
        the modules."""
        if self.is_linear:
            return gated_delta_layer_step(self, self.end, x, gdn, self.slot)
        attn = self["self_attn"]
        heads, kv_heads = attn.heads, attn.kv_heads
        stepped = GATED_ATTENTION_STEP(
            self, self.end, x, offset, (heads, kv_heads, attn.head_dim),
            ((heads, kv_heads, attn["q_norm"].eps), rope.dims, rope.base), kv=kv[self.slot],
        )  # fmt: skip
        return None if stepped is None else stepped[0]


def step_weights(attn: GatedAttention) -> tuple[WeightT | mx.array, ...] | None:
    """What a full-attention layer's step reads: q/k/v stacked and transposed
    (or packed), the scaled q_norm and the k_norm weights, the output
    projection alike (:func:`transposed`); None where a projection is sharded
    or has a bias."""
    qkv, out = stacked(attn, ("q_proj", "k_proj", "v_proj")), attn["o_proj"]
    if qkv is None or qkv.bias is not None or not readable(out):
        return None
    return qkv.weight_t, scaled_query_norm(attn), attn["k_norm"]["weight"], transposed(out)


def step_paths(attn: GatedAttention) -> list[tuple[str, ...]]:
    """The paths from the attention module to each parameter :func:`step_weights` reads."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    return [(name, "weight") for name in names]


def step_inputs(
    projected: mx.array,
    norms: tuple[mx.array, mx.array],
    start: mx.array,
    dims: tuple[int, int, float],
    rotary_dims: int,
    base: float,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A step's heads from its stacked q/k/v row ``(1, width)``:
    :func:`attention_inputs` (RoPE from *start*), the output gate beside them."""
    heads, kv_heads, _ = dims
    dim = norms[0].shape[-1]
    splits = [2 * heads * dim, (2 * heads + kv_heads) * dim]
    q, k, v = mx.split(projected[None], splits, axis=-1)
    return attention_inputs(q, k, v, norms, start, dims, rotary_dims, base)


# A full-attention layer's decode step as one trace (the MTP head's too): the
# queries, their output gate, normed keys and partial RoPE from stacked q/k/v.
GATED_ATTENTION_STEP = AttentionStep(step_inputs, step_weights, step_paths)


class TextStack(nn.Module):
    """``model.*``: embeddings, layers and the final norm."""

    def __init__(self, arch: QwenGdnConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        slots = {True: 0, False: 0}
        self.layers = []
        for i in range(arch.num_hidden_layers):
            kind = arch.is_linear(i)
            self.layers.append(DecoderLayer(arch, i, slots[kind]))
            slots[kind] += 1
        self.norm = nn.RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)


class MtpHead(nn.Module):
    """``mtp.*``, the multi-token-prediction head: the two input norms, the
    ``2H -> H`` fusion, one full-attention layer and its output norm (its math
    and how it drafts: :mod:`turbospark_qwen_gdn.mtp`)."""

    def __init__(self, arch: QwenGdnConfig):
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [DecoderLayer(arch, 0, slot=0, full=True)]
        self.norm = nn.RMSNorm(hidden, eps=eps)


class QwenGdn(nn.Module):
    def __init__(self, arch: QwenGdnConfig, mtp: bool = False):
        """*mtp*: also build the multi-token-prediction head (the checkpoint carries ``mtp.*``)."""
        super().__init__()
        self.arch = arch
        self.model = TextStack(arch)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if mtp:
            self.mtp = MtpHead(arch)
        self._rope = QwenRope(arch)

    def __call__(
        self,
        tokens: mx.array,
        offset: int | mx.array,
        state: State,
        vision: VisionMap | None = None,
        steer: LayerHook | None = None,
    ) -> mx.array:
        """Advance *state* over ``tokens`` ``(B, L)``, row ``i`` from position
        ``offset`` (an int for one session, ``(B,)`` for a batch); returns the
        final-normed hidden states ``(B, L, hidden)``. Every component advances by L.
        *steer* sees each layer's output (after the MLP's residual join); None adds no op."""
        length = tokens.shape[1]
        h = self.model.embed_tokens(tokens)  # (B, L, hidden)
        positions = None
        if vision is not None:  # one session: the map covers its prompt
            assert isinstance(offset, int)
            h = vision.inject(h[0], offset)[None]
            positions = vision.rope_positions(offset, length)  # (3, L)
        if isinstance(offset, int) and positions is None:
            # RoPE's offset as a device array once per forward, not once per layer.
            offset = mx.array(offset, dtype=mx.int32)
        kv, gdn = state["kv"], state["gdn"]
        for i, layer in enumerate(self.model.layers):
            h = layer(h, kv, gdn, self._rope, offset, positions, joiner(steer, i))
        kv.advance(length)
        gdn.advance(length)
        norm = self.model.norm
        return normed_input(h, norm["weight"], norm.eps)[1]

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallelism across *group* (:mod:`turbospark.layers.sharding`): full
        attention by head, gated DeltaNet by key/value head, the MLP by width;
        embeddings, norms and the head stay whole."""
        arch = self.arch
        # Every check before any weight moves.
        kv_copies(group, arch.num_attention_heads, arch.num_key_value_heads)
        require_divisible(
            group,
            intermediate_size=arch.intermediate_size,
            linear_num_key_heads=arch.linear_num_key_heads,
            linear_num_value_heads=arch.linear_num_value_heads,
        )
        for layer in self.model.layers:
            if layer.is_linear:
                shard_gated_delta(layer.linear_attn, group)
            else:
                attn = layer.self_attn
                attn.heads, attn.kv_heads = shard_attention(
                    attn, group, heads=attn.heads, kv_heads=attn.kv_heads
                )
            shard_mlp(layer.mlp, group)

    def head(self, hidden: mx.array) -> mx.array:
        if self.arch.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)
