"""qwen4_exp: an experimental Qwen hybrid carrying every kind of state turbospark knows.

One layer stack of two mixers, chosen by ``full_attention_interval`` (layer
``i`` is a QSA layer when ``(i + 1) % interval == 0``, as Qwen3.5 places its
full-attention layers):

- gated DeltaNet (``linear_attn.*``): the core
  :class:`~turbospark.layers.gated_delta.layer.GatedDeltaNet`, unchanged;
- query-sparse attention (``self_attn.*``): GQA with q/k RMSNorm and partial
  RoPE, plus a one-head indexer choosing which key blocks each query sees
  (:mod:`turbospark_qwen4_exp.qsa`).

Each layer is pre-norm mixer + pre-norm SwiGLU MLP. One layer (``ple_layer``)
also adds a per-layer input, Gemma-PLE style: an embedding of a hash of the
last ``ngram_n`` token ids, run through a dilated causal depthwise conv, gated
by the hidden state, projected and normed. The head is a plain (optionally
tied) linear.

Shapes: hidden states are ``(B, L, hidden)``: one session is ``B = 1``; a
batch (:mod:`turbospark.state.kv`) stacks several sessions, row ``i`` at its own
position ``positions[i]``. Embeddings, the n-gram PLE, every gated-DeltaNet
layer, the norms, MLPs and head run over the whole batch; a QSA layer's
projections and RoPE do too, but its attention runs row by row (each row
over its own K/V columns and its own block selection) unless every row is
still dense, when one masked attention takes them all.
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import Field, model_validator

from turbospark.sdk import (
    ArchConfig,
    BatchLayerKV,
    GatedDeltaNet,
    GatedMLP,
    GDNDims,
    KVComponent,
    LayerHook,
    LayerKV,
    State,
    VisionMap,
    apply_rope,
    rope_freqs,
)
from turbospark_qwen4_exp.qsa import QSABudget, qsa_attention
from turbospark_qwen4_exp.state import LayerIndex

# Any fixed odd multiplier spreads n-grams over the buckets; a prime avoids
# structure when ``ngram_buckets`` is a power of two.
NGRAM_MULTIPLIER = 1_000_003


class Qwen4ExpConfig(ArchConfig):
    """``config.json`` of a ``qwen4_exp`` checkpoint (Qwen3.5 key names where they exist)."""

    model_type: Literal["qwen4_exp"] = "qwen4_exp"
    # Required: the n-gram context of a fresh session is filled with this id.
    eos_token_id: int | list[int]
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    # Qwen3.5 rotates only the first quarter of each head.
    partial_rotary_factor: float = Field(0.25, gt=0.0, le=1.0)
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    full_attention_interval: int = Field(4, gt=0)
    linear_num_key_heads: int = Field(gt=0)
    linear_num_value_heads: int = Field(gt=0)
    linear_key_head_dim: int = Field(gt=0)
    linear_value_head_dim: int = Field(gt=0)
    linear_conv_kernel_dim: int = Field(4, ge=2)
    # Query-sparse attention: indexer width and budget (dense while a query has
    # at most qsa_top_blocks candidate blocks; see qsa.py).
    index_head_dim: int = Field(gt=0)
    qsa_block_size: int = Field(64, gt=0)
    qsa_top_blocks: int = Field(16, gt=0)
    qsa_local_window: int = Field(512, gt=0)
    # The n-gram per-layer input. Bucket ids are computed in int64, so the table
    # must stay below 2**31 rows for the hash to be exact.
    ngram_n: int = Field(3, ge=2)
    ngram_buckets: int = Field(gt=0, lt=2**31)
    hidden_size_per_layer_input: int = Field(gt=0)
    ple_layer: int = Field(0, ge=0)
    ple_conv_kernel: int = Field(4, ge=2)
    ple_conv_dilation: int = Field(1, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Qwen4ExpConfig:
        if self.ple_layer >= self.num_hidden_layers:
            raise ValueError(
                f"ple_layer {self.ple_layer} is past the last of {self.num_hidden_layers} layers"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self

    def is_qsa(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def qsa_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_qsa(i)]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_qsa(i)]

    @property
    def ngram_pad_id(self) -> int:
        """The id standing before the first token in every n-gram."""
        eos = self.eos_token_id
        return eos if isinstance(eos, int) else eos[0]

    @property
    def ple_conv_rows(self) -> int:
        """Past rows the dilated conv reads: ``(kernel - 1) * dilation``."""
        return (self.ple_conv_kernel - 1) * self.ple_conv_dilation

    @property
    def budget(self) -> QSABudget:
        return QSABudget(self.qsa_block_size, self.qsa_top_blocks, self.qsa_local_window)


def sanitize(weights: dict[str, mx.array], arch: Qwen4ExpConfig) -> dict[str, mx.array]:
    """HF tensors -> this module's parameters (pure: returns a new dict).

    - depthwise conv weights (GDN ``conv1d``, ``ple_conv``) go from PyTorch's
      ``(C, 1, K)`` to MLX's ``(C, K, 1)``; already-converted ones pass;
    - a tied checkpoint's redundant ``lm_head.weight`` is dropped.
    """
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if arch.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith(("conv1d.weight", "ple_conv.weight")) and value.shape[-1] != 1:
            value = mx.moveaxis(value, 2, 1)  # (C, 1, K) -> (C, K, 1)
        out[name] = value
    return out


def ngram_hash(window: mx.array, n: int, buckets: int) -> mx.array:
    """Bucket of the n-gram ending at each position.

    ``window`` is ``(..., n - 1 + L)`` ids (the stored context, then the
    chunk; any leading batch axes); returns ``(..., L)`` int32 rows of
    ``embed_ngram``. Oldest id first:
    ``h = (h * NGRAM_MULTIPLIER + id + 1) mod buckets`` (the ``+ 1`` keeps id 0
    from vanishing), in int64 so no product overflows.
    """
    length = window.shape[-1] - (n - 1)
    ids = window.astype(mx.int64)
    bucket = mx.zeros((*window.shape[:-1], length), dtype=mx.int64)
    for j in range(n):
        bucket = (bucket * NGRAM_MULTIPLIER + ids[..., j : j + length] + 1) % buckets
    return bucket.astype(mx.int32)


class QSAttention(nn.Module):
    """GQA attention whose keys are chosen per query by a one-head block indexer."""

    def __init__(self, arch: Qwen4ExpConfig):
        super().__init__()
        self.heads = arch.num_attention_heads
        self.kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.budget = arch.budget
        hidden, width = arch.hidden_size, arch.head_dim
        self.q_proj = nn.Linear(hidden, self.heads * width, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * width, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * width, bias=False)
        self.o_proj = nn.Linear(self.heads * width, hidden, bias=False)
        self.q_norm = nn.RMSNorm(width, eps=arch.rms_norm_eps)
        self.k_norm = nn.RMSNorm(width, eps=arch.rms_norm_eps)
        self.index_q_proj = nn.Linear(hidden, arch.index_head_dim, bias=False)
        self.index_k_proj = nn.Linear(hidden, arch.index_head_dim, bias=False)
        # Qwen-style partial RoPE: the first `rotated` dims, exponents over those dims.
        self.rotated = int(width * arch.partial_rotary_factor)
        self._freqs = rope_freqs(self.rotated, arch.rope_theta)  # "_": not a parameter

    def __call__(
        self,
        x: mx.array,
        positions: list[int],
        offset: int | mx.array,
        kv: LayerKV | BatchLayerKV,
        index: LayerIndex | list[LayerIndex],
    ) -> mx.array:
        """``x`` ``(B, L, hidden)``, row ``i`` at positions ``positions[i]..``
        (*offset*: the same for RoPE, an int for one session, ``(B,)`` for a
        batch); appends to *kv* and *index* (one session's, or a batch's: one
        index per row)."""
        batch, length, _ = x.shape
        # (B, L, heads * dim) -> (B, L, heads, dim) -> (B, heads, L, dim)
        q = self.q_norm(self.q_proj(x).reshape(batch, length, self.heads, -1))
        k = self.k_norm(self.k_proj(x).reshape(batch, length, self.kv_heads, -1))
        v = self.v_proj(x).reshape(batch, length, self.kv_heads, -1).transpose(0, 2, 1, 3)
        q = apply_rope(q.transpose(0, 2, 1, 3), offset, self.rotated, self._freqs)
        k = apply_rope(k.transpose(0, 2, 1, 3), offset, self.rotated, self._freqs)
        keys, values, _ = kv.update_and_fetch(k, v)  # every token so far (kv has no window)
        index_q, index_k = self.index_q_proj(x), self.index_k_proj(x)  # (B, L, index_head_dim)
        scale = self.head_dim**-0.5
        if isinstance(index, LayerIndex):  # one session: its K/V are exactly its tokens
            pooled = index.append(index_k[0])  # (blocks, index_head_dim)
            out = qsa_attention(q, keys, values, index_q[0], pooled, positions[0], self.budget, scale)  # fmt: skip
        else:
            assert isinstance(kv, BatchLayerKV)
            out = self._rows(q, keys, values, index_q, index_k, positions, kv, index, scale)
        # (B, heads, L, dim) -> (B, L, heads * dim)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def _rows(
        self,
        q: mx.array,
        keys: mx.array,
        values: mx.array,
        index_q: mx.array,
        index_k: mx.array,
        positions: list[int],
        kv: BatchLayerKV,
        index: list[LayerIndex],
        scale: float,
    ) -> mx.array:
        """A batch's attention. Every row's index takes its keys; while every
        row's last query is dense (at most ``top_blocks`` candidate blocks:
        plain causal attention) one attention takes every row, masked to each
        row's own columns; otherwise each row attends alone, over its K/V
        columns (left-padded: row ``i``'s start at ``kv.left[i]``) and its own
        selection, exactly as one session does, and the rows are concatenated."""
        length = q.shape[2]
        pooled = [row.append(index_k[i]) for i, row in enumerate(index)]
        if all(self.budget.is_dense(start + length - 1) for start in positions):
            mask = kv.mask(length, 0, keys.shape[2])
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
        outs = []
        for i, start in enumerate(positions):
            left = kv.left[i]
            outs.append(
                qsa_attention(
                    q[i : i + 1], keys[i : i + 1, :, left:], values[i : i + 1, :, left:],
                    index_q[i], pooled[i], start, self.budget, scale,
                )
            )  # fmt: skip
        return mx.concatenate(outs, axis=0)


class DecoderLayer(nn.Module):
    def __init__(self, arch: Qwen4ExpConfig, layer: int):
        super().__init__()
        self.is_qsa = arch.is_qsa(layer)
        if self.is_qsa:
            self.self_attn = QSAttention(arch)
        else:
            self.linear_attn = GatedDeltaNet(GDNDims.of(arch))
        hidden = arch.hidden_size
        self.input_layernorm = nn.RMSNorm(hidden, eps=arch.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=arch.rms_norm_eps)
        self.mlp = GatedMLP(hidden, arch.intermediate_size)
        self.has_ple = layer == arch.ple_layer
        if self.has_ple:
            ple = arch.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(hidden, ple, bias=False)
            self.per_layer_projection = nn.Linear(ple, hidden, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(hidden, eps=arch.rms_norm_eps)

    def __call__(
        self,
        h: mx.array,
        positions: list[int],
        offset: int | mx.array,
        state: State,
        slot: int,
        per_layer: mx.array,
    ) -> mx.array:
        """``h`` ``(B, L, hidden)``, row ``i`` at ``positions[i]..`` (*offset* for
        RoPE); *slot* is this layer's index in its components (kv/qsa, or gdn)."""
        x = self.input_layernorm(h)
        if self.is_qsa:
            kv, index = state["kv"][slot], state["qsa"][slot]
            mixed = self.self_attn(x, positions, offset, kv, index)
        else:
            mixed = self.linear_attn(x, state["gdn"], slot)
        h = h + mixed
        h = h + self.mlp(self.post_attention_layernorm(h))
        if self.has_ple:
            # The hidden state gates the n-gram features (Gemma's PLE, with SiLU).
            gated = nn.silu(self.per_layer_input_gate(h)) * per_layer
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h


class Qwen4ExpModel(nn.Module):
    """The ``model.*`` tensors."""

    def __init__(self, arch: Qwen4ExpConfig):
        super().__init__()
        ple = arch.hidden_size_per_layer_input
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.embed_ngram = nn.Embedding(arch.ngram_buckets, ple)
        self.ple_conv = nn.Conv1d(
            ple, ple, arch.ple_conv_kernel, dilation=arch.ple_conv_dilation, groups=ple, bias=False
        )
        self.layers = [DecoderLayer(arch, i) for i in range(arch.num_hidden_layers)]
        self.norm = nn.RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)


class Qwen4Exp(nn.Module):
    def __init__(self, arch: Qwen4ExpConfig):
        super().__init__()
        self.arch = arch
        self.model = Qwen4ExpModel(arch)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        # Layer index -> index in its components: QSA layers in kv/qsa, the rest in gdn.
        self._slots = {layer: i for i, layer in enumerate(arch.qsa_layers)}
        self._slots.update({layer: i for i, layer in enumerate(arch.gdn_layers)})

    def per_layer_input(self, tokens: mx.array, state: State) -> mx.array:
        """``(B, L)`` ids -> ``(B, L, hidden_size_per_layer_input)`` PLE features."""
        arch = self.arch
        window = state["ngram_context"].push(tokens.astype(mx.int32))  # (B, n - 1 + L)
        rows = self.model.embed_ngram(ngram_hash(window, arch.ngram_n, arch.ngram_buckets))
        # (B, (kernel - 1) * dilation + L, ple): exactly the rows the causal conv reads
        conv_in = state["ple_conv_tail"].push(rows)
        return self.model.ple_conv(conv_in)  # (B, L, ple)

    def __call__(
        self,
        tokens: mx.array,
        positions: list[int],
        state: State,
        vision: VisionMap | None,
        steer: LayerHook | None = None,
    ) -> mx.array:
        """Advance every component of *state* over ``(B, L)`` tokens, row ``i``
        from ``positions[i]`` (one session: ``B = 1`` and its own state; a
        batch: the merged state); return the final-normed hidden states
        ``(B, L, hidden)``. *steer* sees each layer's output (after the MLP's
        residual join and its PLE); None adds no op. *vision* is one session's."""
        length = tokens.shape[1]
        h = self.model.embed_tokens(tokens)  # (B, L, hidden)
        if vision is not None:
            # Text-only RoPE: injected image rows use plain token positions.
            h = vision.inject(h[0], positions[0])[None]
        per_layer = self.per_layer_input(tokens, state)
        # RoPE's offset: an int for one session, one position per row for a batch.
        batched = not isinstance(state["kv"], KVComponent)
        offset = mx.array(positions) if batched else positions[0]
        for i, layer in enumerate(self.model.layers):
            h = layer(h, positions, offset, state, self._slots[i], per_layer)
            if steer is not None:
                h = steer(i, h)
        for name in ("kv", "qsa", "gdn"):
            state[name].advance(length)
        return self.model.norm(h)

    def head(self, hidden: mx.array) -> mx.array:
        if self.arch.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)
