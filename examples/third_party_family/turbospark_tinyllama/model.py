"""A plain Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Read top to bottom it is the architecture mlx-lm's ``llama.py`` computes; the
differences are only where the state lives. Attention appends to a
:class:`turbospark.state.kv.LayerKV` through the core's
:func:`~turbospark.layers.attention.cached_attention` (one tested masking
path for every family), and positions are absolute (``start``), so the runner
can rewind, park and resume a session without the model knowing.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from pydantic import Field, field_validator, model_validator

from turbospark.sdk import (
    ArchConfig,
    GatedMLP,
    Join,
    KVComponent,
    LayerEnd,
    LayerHook,
    LayerKV,
    Unjoined,
    VisionMap,
    apply_rope,
    cached_attention,
    joiner,
    normed_input,
    rope_freqs,
)


class LlamaConfig(ArchConfig):
    """The HF ``config.json`` of a Llama checkpoint, under its own key names."""

    model_type: str = "llama"
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    # Absent in the original Llama configs: then every head has its own K/V (no GQA).
    num_key_value_heads: int | None = None
    # Absent in most configs: then hidden_size is split evenly over the heads.
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    # mlx-lm defaults this to True; real configs always state it, ours too.
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096

    @field_validator("rope_scaling")
    @classmethod
    def _plain_rope_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise ValueError(
                f"rope_scaling {value!r} is not implemented by the tinyllama example; "
                "only plain RoPE checkpoints load"
            )
        return value

    @model_validator(mode="after")
    def _heads_divide(self) -> LlamaConfig:
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.kv_heads})"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dims_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.kv_heads
        self.head_dim = cfg.dims_per_head
        self.scale = self.head_dim**-0.5
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)
        # Underscore: a constant, not a parameter (nn.Module skips `_` attributes).
        self._freqs = rope_freqs(self.head_dim, cfg.rope_theta)

    def __call__(self, x: mx.array, start: int, kv: LayerKV) -> mx.array:
        _, length, _ = x.shape

        def heads(t: mx.array, n: int) -> mx.array:
            # (1, L, n * head_dim) -> (1, n, L, head_dim)
            return t.reshape(1, length, n, self.head_dim).transpose(0, 2, 1, 3)

        q = apply_rope(heads(self.q_proj(x), self.n_heads), start, self.head_dim, self._freqs)
        k = apply_rope(heads(self.k_proj(x), self.n_kv_heads), start, self.head_dim, self._freqs)
        v = heads(self.v_proj(x), self.n_kv_heads)
        out, _ = cached_attention(q, k, v, kv, self.scale)  # (1, heads, L, head_dim)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, length, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)  # SwiGLU
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        # After attention, pre-norm: h += attn; h + mlp(post_attention_layernorm(h)).
        # The SDK's block runs it in the fastest form the device has (one compiled
        # step; on CUDA the joins with their norms in one kernel, the last one
        # left unjoined for the next layer's input norm).
        self.end = LayerEnd("post_attention_layernorm", cfg.rms_norm_eps)

    def __call__(
        self, x: mx.array | Unjoined, start: int, kv: LayerKV, join: Join | None = None
    ) -> mx.array | Unjoined:
        # normed_input: x's RMS norm, joining x first where the last layer left it unjoined.
        x, normed = normed_input(x, self.input_layernorm.weight, self.input_layernorm.eps)
        return self.end(self, x, self.self_attn(normed, start, kv), join=join)


class LlamaModel(nn.Module):
    """The ``model.*`` tensors of the checkpoint (embeddings, layers, final norm)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(
        self,
        tokens: mx.array,
        start: int,
        kv: KVComponent,
        vision: VisionMap | None,
        steer: LayerHook | None = None,
    ) -> mx.array:
        """Final hidden states ``(L, hidden)`` for ``tokens`` (``(L,)``) at ``start..``.

        *steer* (activation steering) sees each layer's output, after the MLP's
        residual join; None adds no op.

        A vision map replaces the embeddings it covers; Llama's RoPE is 1-D, so
        positions stay the token indices.
        """
        h = self.model.embed_tokens(tokens)  # (L, hidden)
        if vision is not None:
            h = vision.inject(h, start)
        h = h[None]  # (1, L, hidden)
        for index, layer in enumerate(self.model.layers):
            # joiner: the layer's last join with the steering in it (None: no op).
            h = layer(h, start, kv[index], joiner(steer, index))
        kv.advance(tokens.shape[0])
        norm = self.model.norm
        return normed_input(h, norm.weight, norm.eps)[1][0]

    def head(self, h: mx.array) -> mx.array:
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)


def sanitize(weights: dict[str, mx.array], cfg: LlamaConfig) -> dict[str, mx.array]:
    """All weight surgery in one place: HF checkpoints may carry precomputed
    rotary tables (unused: RoPE is computed) and a tied head's duplicate."""
    out = {k: v for k, v in weights.items() if "self_attn.rotary_emb.inv_freq" not in k}
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
