"""Random-weight Gemma 4 installs with the real Hugging Face tensor names.

The install goes through :func:`turbospark.loading.install.write_install`, the writer a
real import uses, and loads unchanged in ``mlx_lm.utils.load_model``. Weights
are deliberately not "neutral": norm scales, router scales and layer scalars
are random, so a skipped norm or a misplaced scalar changes the logits.
"""

from __future__ import annotations

from pathlib import Path

from turbospark.sdk import GEMMA_TEXT, RandomWeights, write_synthetic
from turbospark_gemma4.model import Gemma4Config


def build(
    path: Path,
    *,
    vocab_size: int = 128,
    num_layers: int = 2,
    num_experts: int = 0,
    top_k_experts: int = 2,
    sliding_window: int = 8,
    model_id: str = "synthetic-gemma4",
    seed: int = 0,
    dtype: str = "float32",
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    global_head_dim: int = 32,
    intermediate_size: int = 96,
    moe_intermediate_size: int = 32,
    hidden_size_per_layer_input: int = 16,
    num_kv_shared_layers: int | None = None,
    attention_k_eq_v: bool = False,
    num_global_key_value_heads: int | None = None,
) -> Gemma4Config:
    """Write a synthetic install at *path* and return its arch.

    By default the last ``num_layers // 2`` layers share K/V once there are at
    least 4 layers; layers alternate sliding/full, so both kinds own K/V.
    ``num_experts > 0`` enables the MoE block; ``hidden_size_per_layer_input=0``
    disables PLE.
    """
    if num_kv_shared_layers is None:
        num_kv_shared_layers = num_layers // 2 if num_layers >= 4 else 0
    moe = num_experts > 0
    arch = Gemma4Config(
        family="gemma4",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        num_key_value_heads=num_key_value_heads,
        num_global_key_value_heads=num_global_key_value_heads,
        num_kv_shared_layers=num_kv_shared_layers,
        hidden_size_per_layer_input=hidden_size_per_layer_input,
        vocab_size_per_layer_input=vocab_size,
        sliding_window=sliding_window,
        # Alternate sliding/full so both kinds appear among any >= 2 owning layers.
        sliding_window_pattern=2,
        max_position_embeddings=4096,
        attention_k_eq_v=attention_k_eq_v,
        enable_moe_block=moe,
        num_experts=num_experts if moe else None,
        top_k_experts=top_k_experts if moe else None,
        moe_intermediate_size=moe_intermediate_size if moe else None,
        eos_token_id=GEMMA_TEXT.id(GEMMA_TEXT.eos),
        pad_token_id=GEMMA_TEXT.id("<pad>"),
    )
    w = RandomWeights(seed)
    n, hidden, ple = num_layers, hidden_size, hidden_size_per_layer_input
    # Embedding rows of norm ~1: after the sqrt(hidden) embed scale, unit-variance entries.
    w.linear("model.embed_tokens.weight", (vocab_size, hidden))
    w.scale("model.norm.weight", (hidden,))
    if ple:
        w.linear("model.embed_tokens_per_layer.weight", (vocab_size, n * ple))
        w.linear("model.per_layer_model_projection.weight", (n * ple, hidden))
        w.scale("model.per_layer_projection_norm.weight", (ple,))
    for i in range(n):
        p = f"model.layers.{i}"
        dim, kv_heads = arch.layer_head_dim(i), arch.layer_kv_heads(i)
        w.linear(f"{p}.self_attn.q_proj.weight", (num_attention_heads * dim, hidden))
        w.linear(f"{p}.self_attn.o_proj.weight", (hidden, num_attention_heads * dim))
        w.scale(f"{p}.self_attn.q_norm.weight", (dim,))
        # KV-shared layers still carry k/v tensors in HF checkpoints; sanitize drops them.
        w.linear(f"{p}.self_attn.k_proj.weight", (kv_heads * dim, hidden))
        if not arch.k_eq_v(i):
            w.linear(f"{p}.self_attn.v_proj.weight", (kv_heads * dim, hidden))
        w.scale(f"{p}.self_attn.k_norm.weight", (dim,))
        inner = arch.layer_intermediate_size(i)
        w.linear(f"{p}.mlp.gate_proj.weight", (inner, hidden))
        w.linear(f"{p}.mlp.up_proj.weight", (inner, hidden))
        w.linear(f"{p}.mlp.down_proj.weight", (hidden, inner))
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            w.scale(f"{p}.{norm}_layernorm.weight", (hidden,))
        if moe:
            w.linear(f"{p}.router.proj.weight", (num_experts, hidden))
            w.scale(f"{p}.router.scale", (hidden,))
            w.scale(f"{p}.router.per_expert_scale", (num_experts,), spread=0.5)
            w.linear(f"{p}.experts.gate_up_proj", (num_experts, 2 * moe_intermediate_size, hidden))
            w.linear(f"{p}.experts.down_proj", (num_experts, hidden, moe_intermediate_size))
            for norm in (
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2",
            ):
                w.scale(f"{p}.{norm}.weight", (hidden,))
        if ple:
            w.linear(f"{p}.per_layer_input_gate.weight", (ple, hidden))
            w.linear(f"{p}.per_layer_projection.weight", (hidden, ple))
            w.scale(f"{p}.post_per_layer_input_norm.weight", (hidden,))
        w.scale(f"{p}.layer_scalar", (1,), spread=0.5)

    return write_synthetic(path, arch, model_id, w.tensors, dtype, GEMMA_TEXT)
