"""Random-weight qwen4_exp installs, with the checkpoint's tensor names and layouts.

Tensor names and shapes come from the module itself (one source of truth);
values are drawn from one seeded generator and written in the layout a
PyTorch checkpoint uses (depthwise convs ``(C, 1, K)``), so loading goes
through :func:`~turbospark_qwen4_exp.model.sanitize` like a real import.
Norm scales are random around 1, so a skipped norm changes the logits.

The default QSA budget is tiny (blocks of 4, top 2 blocks, a 4-token
window): attention is dense for the first 12 tokens and sparse from the
16th on, so a 40-token test covers both regimes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from turbospark.sdk import QWEN_TEXT, write_synthetic
from turbospark_qwen4_exp.model import Qwen4Exp, Qwen4ExpConfig

_DEPTHWISE = ("conv1d.weight", "ple_conv.weight")


def _draw(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A value for parameter *name* of MLX shape *shape*."""
    if name.endswith("norm.weight") or name.endswith("dt_bias"):
        return 1.0 + rng.uniform(-0.2, 0.2, shape)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))  # decay rates as Qwen3.5 initialises them
    if name.endswith(_DEPTHWISE):
        return rng.normal(0.0, shape[1] ** -0.5, shape)  # (C, K, 1): unit gain over K taps
    if "embed_" in name:
        return rng.normal(0.0, 1.0, shape)
    return rng.normal(0.0, shape[-1] ** -0.5, shape)  # (out, in) linear


def build(
    path: Path,
    *,
    vocab_size: int = 128,
    model_id: str = "synthetic-qwen4-exp",
    seed: int = 0,
    dtype: str = "float32",
    num_layers: int = 4,
    full_attention_interval: int = 2,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 8,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 8,
    linear_value_head_dim: int = 8,
    index_head_dim: int = 8,
    qsa_block_size: int = 4,
    qsa_top_blocks: int = 2,
    qsa_local_window: int = 4,
    ngram_n: int = 3,
    ngram_buckets: int = 64,
    hidden_size_per_layer_input: int = 8,
    ple_layer: int = 1,
    ple_conv_kernel: int = 3,
    ple_conv_dilation: int = 2,
    tie_word_embeddings: bool = False,
) -> Qwen4ExpConfig:
    """Write a synthetic install at *path* and return its arch."""
    arch = Qwen4ExpConfig(
        family="qwen4_exp",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        eos_token_id=QWEN_TEXT.id(QWEN_TEXT.eos),
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        partial_rotary_factor=0.5,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        full_attention_interval=full_attention_interval,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=4,
        index_head_dim=index_head_dim,
        qsa_block_size=qsa_block_size,
        qsa_top_blocks=qsa_top_blocks,
        qsa_local_window=qsa_local_window,
        ngram_n=ngram_n,
        ngram_buckets=ngram_buckets,
        hidden_size_per_layer_input=hidden_size_per_layer_input,
        ple_layer=ple_layer,
        ple_conv_kernel=ple_conv_kernel,
        ple_conv_dilation=ple_conv_dilation,
    )
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for name, param in sorted(tree_flatten(Qwen4Exp(arch).parameters())):
        value = _draw(rng, name, tuple(param.shape))
        if name.endswith(_DEPTHWISE):
            value = np.moveaxis(value, 1, 2)  # MLX (C, K, 1) -> PyTorch (C, 1, K)
        tensors[name] = value
    return write_synthetic(path, arch, model_id, tensors, dtype, QWEN_TEXT)
