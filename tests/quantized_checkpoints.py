"""Quantized checkpoints for the tests, written both ways: by ``mlx_lm.convert -q``
(what mlx-community publishes) and by our converter (``turbospark import
--quantize``), from the same synthetic floating-point install
(`tests/test_import_quantize.py`, `tests/test_quantized_parity.py`)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.convert import convert
from mlx_lm.utils import load_model

from turbospark import build_synthetic_install
from turbospark.loading.importer import import_checkpoint
from turbospark.loading.quantization import QuantSpec

# Each family mlx-lm has, small, with widths the group sizes below divide
# (gemma4's per-layer input at 32, so its projection is packed too).
MLX_LM_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma4": ("gemma4", {"num_layers": 4, "hidden_size_per_layer_input": 32}),
    "gemma4_moe": (
        "gemma4",
        {"num_layers": 2, "num_experts": 4, "hidden_size_per_layer_input": 32},
    ),
    "qwen_gdn": ("qwen_gdn", {"num_layers": 4}),
    # The head is the packed embedding (QuantizedEmbedding.as_linear).
    "qwen_gdn_tied": ("qwen_gdn", {"num_layers": 4, "tie_word_embeddings": True}),
}
VOCAB = 128
# mlx-lm's quant_predicate: a module's settings, or False to keep it in floating point.
Predicate = Callable[[str, nn.Module], bool | dict[str, Any]]


def source(name: str, path: Path) -> Path:
    """The floating-point synthetic install of *name* (a key of MLX_LM_FAMILIES)."""
    family, dims = MLX_LM_FAMILIES[name]
    build_synthetic_install(family, path, vocab_size=VOCAB, seed=5, model_id=name, **dims)
    return path


def mlx_lm_convert(
    src: Path, dst: Path, spec: QuantSpec, predicate: str | Predicate | None = None
) -> Path:
    """``mlx_lm.convert -q`` in float32, its chatter kept off the test output;
    with *predicate* as its ``quant_predicate``: a recipe (``mixed_4_6``, one
    of ``mlx_lm.convert.QUANT_RECIPES``, as ``--quant-predicate`` takes it) or
    a function of the module path and module, which pick each module's
    settings themselves (*spec*'s bits then only fill the config's default)."""
    with contextlib.redirect_stdout(io.StringIO()):
        convert(
            hf_path=str(src),
            mlx_path=str(dst),
            quantize=True,
            q_bits=spec.bits,
            q_group_size=spec.group_size,
            q_mode=spec.mode,
            dtype="float32",
            quant_predicate=predicate,
        )
    return dst


def our_convert(src: Path, dst: Path, spec: QuantSpec) -> Path:
    import_checkpoint(src, dst, quantize=spec, progress=False)
    return dst


def mlx_lm_parameters(path: Path) -> dict[str, mx.array]:
    """The parameters mlx-lm's own loader gives the checkpoint at *path*."""
    model, _ = load_model(path)
    return dict(tree_flatten(model.parameters()))
