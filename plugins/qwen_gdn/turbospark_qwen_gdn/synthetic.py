"""Random-weight Qwen3.5 installs with the tensor names and layout of a real checkpoint.

Tensors are named ``model.language_model.*`` (as Qwen's multimodal releases
name them), conv1d weights are stored ``(C, 1, K)`` and the RMSNorm weights
zero-centred, so loading goes through the same sanitize a real checkpoint
does. The install is written by :func:`turbospark.loading.install.write_install` and
loads unchanged in ``mlx_lm.utils.load_model``. Nothing is neutral: norms,
decays (``A_log``, ``dt_bias``) and step sizes are random, so a skipped norm
or a mis-wired gate changes the logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from turbospark.sdk import QWEN_TEXT, GDNDims, RandomWeights, write_synthetic
from turbospark_qwen_gdn.model import QwenGdnConfig, RopeParameters


def _mrope_section(rotary_dims: int) -> tuple[int, int, int]:
    """Split the rotated frequencies over (t, h, w) as Qwen does (32 -> 11, 11, 10)."""
    half = rotary_dims // 2
    base, extra = divmod(half, 3)
    return (base + (extra > 0), base + (extra > 1), base)


def build(
    path: Path,
    *,
    vocab_size: int = 128,
    num_layers: int = 4,
    model_id: str = "synthetic-qwen-gdn",
    seed: int = 0,
    dtype: str = "float32",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    linear_num_value_heads: int = 4,
    linear_num_key_heads: int = 2,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 24,
    linear_conv_kernel_dim: int = 4,
    full_attention_interval: int = 4,
    partial_rotary_factor: float = 0.25,
    rope_theta: float = 10_000_000.0,
    tie_word_embeddings: bool = False,
    mtp: bool = False,
) -> QwenGdnConfig:
    """Write a synthetic install at *path* and return its arch.

    Layer ``i`` is full attention when ``(i + 1) % full_attention_interval == 0``
    (layers 0-2 linear and 3 full by default). Key and value head dims differ
    on purpose, so a transposed recurrent state cannot go unnoticed. *mtp* adds
    the multi-token-prediction head (``mtp.*``, one full-attention layer, named
    and stored as Qwen3.5 releases store it) for ``DraftPolicies.mtp``.
    """
    rotary = int(head_dim * partial_rotary_factor)
    arch = QwenGdnConfig(
        family="qwen_gdn",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        linear_num_value_heads=linear_num_value_heads,
        linear_num_key_heads=linear_num_key_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=linear_conv_kernel_dim,
        full_attention_interval=full_attention_interval,
        tie_word_embeddings=tie_word_embeddings,
        mtp_num_hidden_layers=int(mtp),
        rope_parameters=RopeParameters(
            rope_theta=rope_theta,
            partial_rotary_factor=partial_rotary_factor,
            mrope_section=_mrope_section(rotary),
        ),
        eos_token_id=QWEN_TEXT.id(QWEN_TEXT.eos),
    )
    w = RandomWeights(seed)
    hidden, root = hidden_size, "model.language_model"
    w.linear(f"{root}.embed_tokens.weight", (vocab_size, hidden))
    w.centred(f"{root}.norm.weight", (hidden,))
    if not tie_word_embeddings:
        w.linear("lm_head.weight", (vocab_size, hidden))
    gdn = GDNDims.of(arch)
    layers = [(f"{root}.layers.{i}", arch.is_linear(i)) for i in range(num_layers)]
    if mtp:
        w.centred("mtp.pre_fc_norm_embedding.weight", (hidden,))
        w.centred("mtp.pre_fc_norm_hidden.weight", (hidden,))
        w.linear("mtp.fc.weight", (hidden, 2 * hidden))
        w.centred("mtp.norm.weight", (hidden,))
        layers.append(("mtp.layers.0", False))  # a full-attention layer like the stack's
    for p, linear in layers:
        if linear:
            a = f"{p}.linear_attn"
            w.linear(f"{a}.in_proj_qkv.weight", (gdn.conv_dim, hidden))
            w.linear(f"{a}.in_proj_z.weight", (gdn.value_dim, hidden))
            w.linear(f"{a}.in_proj_b.weight", (gdn.num_value_heads, hidden))
            w.linear(f"{a}.in_proj_a.weight", (gdn.num_value_heads, hidden))
            w.linear(f"{a}.conv1d.weight", (gdn.conv_dim, 1, gdn.conv_kernel))  # HF (C, 1, K)
            # Per-head decay rates from slow to fast, so some heads carry state
            # across many chunks and others forget within a few tokens.
            w.tensors[f"{a}.A_log"] = np.log(w.rng.uniform(0.05, 2.0, (gdn.num_value_heads,)))
            w.tensors[f"{a}.dt_bias"] = w.rng.normal(-1.0, 0.5, (gdn.num_value_heads,))
            w.scale(f"{a}.norm.weight", (gdn.value_head_dim,))
            w.linear(f"{a}.out_proj.weight", (hidden, gdn.value_dim))
        else:
            a = f"{p}.self_attn"
            w.linear(f"{a}.q_proj.weight", (2 * num_attention_heads * head_dim, hidden))
            w.linear(f"{a}.k_proj.weight", (num_key_value_heads * head_dim, hidden))
            w.linear(f"{a}.v_proj.weight", (num_key_value_heads * head_dim, hidden))
            w.linear(f"{a}.o_proj.weight", (hidden, num_attention_heads * head_dim))
            w.centred(f"{a}.q_norm.weight", (head_dim,))
            w.centred(f"{a}.k_norm.weight", (head_dim,))
        w.linear(f"{p}.mlp.gate_proj.weight", (intermediate_size, hidden))
        w.linear(f"{p}.mlp.up_proj.weight", (intermediate_size, hidden))
        w.linear(f"{p}.mlp.down_proj.weight", (hidden, intermediate_size))
        w.centred(f"{p}.input_layernorm.weight", (hidden,))
        w.centred(f"{p}.post_attention_layernorm.weight", (hidden,))

    return write_synthetic(path, arch, model_id, w.tensors, dtype, QWEN_TEXT)
