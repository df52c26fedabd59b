"""Tensor parallelism of quantized checkpoints on CPU: a checkpoint quantized by
``mlx_lm.convert -q`` sharded across two processes (MLX's ring backend over
loopback) gives the single-process logits on every rank. Slow: each case starts
a process group (see ``tests/test_distributed.py``)."""

from __future__ import annotations

import json

import pytest
from mlx_lm import convert
from test_distributed import HERE, LOGITS_ATOL, launch

from turbospark import build_synthetic_install
from turbospark.loading.importer import import_checkpoint

# Widths chosen so each rank's half of every projection out of heads (o_proj,
# the MLP's and the experts' down_proj) holds whole groups of 32.
GEMMA = dict(num_layers=2, hidden_size=128, intermediate_size=128)
CASES = {
    "gemma4_moe": (
        "gemma4",
        GEMMA
        | dict(num_experts=8, top_k_experts=2, moe_intermediate_size=64)
        | dict(hidden_size_per_layer_input=0),  # the MoE releases have no PLE
    ),
    # One K/V head, repeated on both ranks: its packed rows, scales and biases
    # alike; per-layer embeddings (packed, whole on every rank).
    "gemma4_one_kv_head": (
        "gemma4",
        GEMMA | dict(num_layers=4, num_key_value_heads=1, num_global_key_value_heads=1),
    ),
    # Gated-DeltaNet mixers sharded by head, packed.
    "qwen_gdn": (
        "qwen_gdn",
        dict(num_layers=4, hidden_size=128, intermediate_size=128, linear_value_head_dim=16),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_quantized_logits_equal_unsharded(case, bits, tmp_path):
    source, mlx_dir, install = tmp_path / "src", tmp_path / "mlx", tmp_path / "install"
    family, dims = CASES[case]
    build_synthetic_install(family, source, vocab_size=128, seed=5, **dims)
    convert(str(source), str(mlx_dir), quantize=True, q_bits=bits, q_group_size=32)
    import_checkpoint(mlx_dir, install, progress=False)
    done = launch(str(HERE / "logits.py"), str(install), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in (0, 1):  # mlx.launch may exit 0 when a rank failed: its output says
        assert (tmp_path / f"out.{rank}").exists(), done.stderr[-2000:]
        result = json.loads((tmp_path / f"out.{rank}").read_text())
        sharded, whole = result["params"]
        assert sharded < 0.75 * whole, "the model was not sharded"
        assert result["diff"] <= LOGITS_ATOL, result
