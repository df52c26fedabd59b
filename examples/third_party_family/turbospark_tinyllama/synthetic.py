"""Random-weight tinyllama installs with the real Hugging Face tensor names.

:mod:`turbospark.synthetic` does the shared part: seeded random tensors, and
the write through :func:`turbospark.install.write_install` (the writer a real
import uses) with a real tokenizer and chat template from
:func:`turbospark.text.synthetic_text_files`. The install loads unchanged in
``mlx_lm.utils.load_model``. Norm scales are random rather than ones, so a
skipped or misplaced norm changes the logits.
"""

from __future__ import annotations

from pathlib import Path

from turbospark.synthetic import RandomWeights, write_synthetic
from turbospark.text import EOS_ID
from turbospark_tinyllama.model import LlamaConfig


def build(
    path: Path,
    *,
    vocab_size: int = 128,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 96,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    model_id: str = "synthetic-tinyllama",
    seed: int = 0,
    dtype: str = "float32",
) -> LlamaConfig:
    """Write a synthetic install at *path* and return its arch."""
    arch = LlamaConfig(
        family="tinyllama",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=EOS_ID,
    )
    w = RandomWeights(seed)
    q_dim, kv_dim = num_attention_heads * head_dim, num_key_value_heads * head_dim
    # Unit-variance embedding rows: Llama does not scale its embeddings.
    w.tensors["model.embed_tokens.weight"] = w.rng.normal(0.0, 1.0, (vocab_size, hidden_size))
    for i in range(num_layers):
        p = f"model.layers.{i}"
        w.linear(f"{p}.self_attn.q_proj.weight", (q_dim, hidden_size))
        w.linear(f"{p}.self_attn.k_proj.weight", (kv_dim, hidden_size))
        w.linear(f"{p}.self_attn.v_proj.weight", (kv_dim, hidden_size))
        w.linear(f"{p}.self_attn.o_proj.weight", (hidden_size, q_dim))
        w.linear(f"{p}.mlp.gate_proj.weight", (intermediate_size, hidden_size))
        w.linear(f"{p}.mlp.up_proj.weight", (intermediate_size, hidden_size))
        w.linear(f"{p}.mlp.down_proj.weight", (hidden_size, intermediate_size))
        w.scale(f"{p}.input_layernorm.weight", (hidden_size,))
        w.scale(f"{p}.post_attention_layernorm.weight", (hidden_size,))
    w.scale("model.norm.weight", (hidden_size,))
    if not tie_word_embeddings:
        w.linear("lm_head.weight", (vocab_size, hidden_size))
    return write_synthetic(path, arch, model_id, w.tensors, dtype)
