"""Random-weight tinyllama installs with the real Hugging Face tensor names.

:mod:`turbospark.loading.synthetic` does the shared part: seeded random tensors, and
the write through :func:`turbospark.loading.install.write_install` (the writer a real
import uses). The family's own part is :data:`LLAMA3_TEXT`: a byte-level BPE
tokenizer and the chat template of Llama 3, as its checkpoints ship them, so
mlx-lm (through ``transformers``) tokenizes a chat exactly as turbospark does.
The install loads unchanged in ``mlx_lm.utils.load_model``. Norm scales are
random rather than ones, so a skipped or misplaced norm changes the logits.
"""

from __future__ import annotations

from pathlib import Path

from turbospark.sdk import RandomWeights, SyntheticText, write_synthetic
from turbospark_tinyllama.model import LlamaConfig

# Llama 3's chat template (tools and dates trimmed): every message in a header
# block, content trimmed, an empty assistant header as the generation prompt.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

LLAMA3_TEXT = SyntheticText(
    kind="byte_level",
    specials=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ),
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    stops=("<|end_of_text|>", "<|eot_id|>"),
    chat_template=LLAMA3_CHAT_TEMPLATE,
    # Llama 3's pre-tokenizer regex (tiktoken's cl100k pattern).
    split_pattern=(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
)


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
        eos_token_id=LLAMA3_TEXT.id(LLAMA3_TEXT.eos),
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
    return write_synthetic(path, arch, model_id, w.tensors, dtype, LLAMA3_TEXT)
