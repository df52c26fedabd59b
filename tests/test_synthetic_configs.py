"""Every family's synthetic ``config.json`` keeps every field its arch declares,
and mlx-lm loads it.

``ArchConfig.hf_config`` writes nulls as nulls: a dropped optional field (a
``head_dim`` of None, say) would make mlx-lm, which requires some of them,
refuse the install, or silently fall back to a default of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turbospark import build_synthetic_install
from turbospark.loading.plugins import default_registry

mlx_lm_utils = pytest.importorskip("mlx_lm.utils", reason="mlx-lm is the oracle")
UPSTREAM = {"gemma4", "qwen_gdn"}  # the built-in families mlx-lm implements


@pytest.mark.parametrize("family", sorted(default_registry().families))
def test_config_json_keeps_every_declared_field(family: str, tmp_path: Path) -> None:
    arch = build_synthetic_install(family, tmp_path, num_layers=2)
    written = json.loads((tmp_path / "config.json").read_text())
    declared = set(type(arch).model_fields) - {"family"}
    assert declared <= set(written), sorted(declared - set(written))
    assert {k: written[k] for k in declared} == arch.hf_config()
    if family in UPSTREAM:
        _, config = mlx_lm_utils.load_model(tmp_path)
        assert config["model_type"] == arch.model_type
