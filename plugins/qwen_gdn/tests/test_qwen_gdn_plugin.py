"""The family declaration, the config as real checkpoints write it, and sanitize."""

from __future__ import annotations

import inspect
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_qwen_gdn.state
from turbospark.sdk import (
    HFConfig,
    InstallError,
    InvalidInput,
    arch_from_config,
    build_synthetic_install,
    family_hooks,
)
from turbospark_qwen_gdn.model import QwenGdnConfig, sanitize

TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 96,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}


def test_family_declaration() -> None:
    hooks = family_hooks("qwen_gdn")
    spec = hooks.turbospark_family()
    assert spec.model_types == ["qwen3_5", "qwen3_5_text"]
    assert spec.state_source == inspect.getsourcefile(
        turbospark_qwen_gdn.state
    )  # wherever it is installed
    assert (
        spec.state_source.endswith("turbospark_qwen_gdn/state.py")
        and Path(spec.state_source).is_file()
    )
    kv, gdn = spec.component("kv"), spec.component("gdn")
    assert (kv.swappable, kv.rewindable, kv.persistable) == (True, True, True)
    assert (gdn.swappable, gdn.rewindable, gdn.persistable) == (True, False, True)
    arch = QwenGdnConfig.model_validate({**TEXT, "family": "qwen_gdn", "model_type": "qwen3_5"})
    assert hooks.turbospark_pool_capability(arch=arch) == ["kv", "gdn"]


def test_nested_hf_config_reads_its_text_config() -> None:
    """A release ``config.json`` nests the decoder (``qwen3_5_text``) under ``text_config``."""
    nested = {
        "model_type": "qwen3_5",
        "text_config": TEXT,
        "vision_config": {"depth": 2},
        "tie_word_embeddings": True,
    }
    arch = arch_from_config(HFConfig.model_validate(nested), QwenGdnConfig, "qwen_gdn")
    flat = arch_from_config(HFConfig.model_validate(TEXT), QwenGdnConfig, "qwen_gdn")
    assert arch == flat and arch.model_type == "qwen3_5_text"
    assert arch.head_dim == 32  # hidden_size // num_attention_heads, as mlx-lm derives it
    assert arch.rotary_dims == 8 and arch.tie_word_embeddings
    assert [arch.is_linear(i) for i in range(4)] == [True, True, True, False]


def test_conflicting_tie_flags_are_refused_by_both_names() -> None:
    """transformers ties by the top-level flag, mlx-lm by the inner one: never guess."""
    nested = {"model_type": "qwen3_5", "text_config": TEXT, "tie_word_embeddings": False}
    with pytest.raises(
        InstallError, match=r"tie_word_embeddings=false but text_config.tie_word_embeddings=true"
    ):
        arch_from_config(HFConfig.model_validate(nested), QwenGdnConfig, "qwen_gdn")


def test_layer_types_are_read_and_must_agree_with_the_interval() -> None:
    types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    arch = QwenGdnConfig.model_validate({**TEXT, "family": "qwen_gdn", "layer_types": types})
    assert [arch.is_linear(i) for i in range(4)] == [True, False, True, False]
    with pytest.raises(ValueError, match="layer_types conflicts with full_attention_interval=4"):
        QwenGdnConfig.model_validate(
            {**TEXT, "family": "qwen_gdn", "layer_types": types, "full_attention_interval": 4}
        )


def test_unknown_synthetic_dims_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="num_experts"):
        build_synthetic_install("qwen_gdn", tmp_path, vocab_size=128, num_experts=4)
    assert not (tmp_path / "manifest.json").exists()


def test_sanitize_real_checkpoint_names() -> None:
    arch = QwenGdnConfig.model_validate({**TEXT, "family": "qwen_gdn", "model_type": "qwen3_5"})
    conv = mx.arange(12, dtype=mx.float32).reshape(6, 1, 2)  # HF (C, 1, K)
    weights = {
        "model.language_model.layers.0.linear_attn.conv1d.weight": conv,
        "model.language_model.layers.0.input_layernorm.weight": mx.zeros((4,)),
        "model.language_model.layers.0.linear_attn.norm.weight": mx.ones((4,)),
        "model.language_model.layers.3.self_attn.q_norm.weight": mx.zeros((4,)),
        "model.language_model.norm.weight": mx.zeros((4,)),
        "model.visual.blocks.0.attn.qkv.weight": mx.zeros((2, 2)),
        "mtp.layers.0.input_layernorm.weight": mx.zeros((4,)),  # the MTP head: kept
        "mtp.pre_fc_norm_hidden.weight": mx.zeros((4,)),
        "mtp.norm.weight": mx.zeros((4,)),
        "mtp.fc.weight": mx.zeros((4, 8)),
        "lm_head.weight": mx.zeros((2, 2)),  # tied: dropped
    }
    out = sanitize(weights, arch)
    assert sorted(out) == [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.0.linear_attn.norm.weight",
        "model.layers.3.self_attn.q_norm.weight",
        "model.norm.weight",
        "mtp.fc.weight",
        "mtp.layers.0.input_layernorm.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_hidden.weight",
    ]
    np.testing.assert_array_equal(
        np.array(out["model.layers.0.linear_attn.conv1d.weight"]), np.array(conv).transpose(0, 2, 1)
    )
    for name in (
        "model.layers.0.input_layernorm.weight",
        "model.layers.3.self_attn.q_norm.weight",
        "model.norm.weight",
        "mtp.layers.0.input_layernorm.weight",  # the MTP head's norms are zero-centred too
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    ):
        np.testing.assert_array_equal(np.array(out[name]), np.ones(4))
    np.testing.assert_array_equal(np.array(out["mtp.fc.weight"]), np.zeros((4, 8)))
    # The gated norm is stored as is.
    np.testing.assert_array_equal(
        np.array(out["model.layers.0.linear_attn.norm.weight"]), np.ones(4)
    )
    assert "model.language_model.layers.0.linear_attn.conv1d.weight" in weights  # input untouched
