"""``turbospark import``: Hugging Face shards -> an install that computes the same logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from turbospark import build_synthetic_install
from turbospark.cli import main
from turbospark.errors import FamilyNotFound, InstallError
from turbospark.importer import import_checkpoint
from turbospark.install import MANIFEST, read_manifest
from turbospark.runner import Runner
from turbospark.text import load_text

PROMPT = [1, 3, 40, 41, 42, 9, 17, 100, 6, 8, 11, 12]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("import-src")
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, sliding_window=8, model_id="src", seed=3
    )
    return path


def as_hf_checkpoint(install: Path, out: Path, shards: int = 2) -> Path:
    """What a Hugging Face download looks like: split shards + index, no manifest."""
    shutil.copytree(install, out)
    (out / MANIFEST).unlink()
    weights = mx.load(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(weights)
    index: dict[str, object] = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: weights[name] for name in names[i::shards]}
        mx.save_safetensors(str(out / file), part, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(part, file))  # type: ignore[union-attr]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def logits(path: Path) -> mx.array:
    return Runner.open(path, context_length=64).prefill_chunk(PROMPT, 0)


def test_an_imported_checkpoint_computes_the_same_logits(source: Path, tmp_path: Path) -> None:
    hf = as_hf_checkpoint(source, tmp_path / "hf")
    manifest = import_checkpoint(hf, tmp_path / "out", model_id="imported", progress=False)
    assert manifest.family == "gemma4" and manifest.model_id == "imported"
    assert set(manifest.files) >= {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert mx.array_equal(logits(tmp_path / "out"), logits(source))  # Runner.open checks sha256s
    model, _ = load_model(tmp_path / "out")  # still a checkpoint mlx-lm loads unchanged
    assert model.model_type == "gemma4_text"
    imported, original = load_text(tmp_path / "out"), load_text(source)
    messages = [{"role": "user", "content": "hi"}]
    assert imported.encode_chat(messages) == original.encode_chat(messages)


def test_a_nested_text_config_and_a_cast_through_the_cli(source: Path, tmp_path: Path) -> None:
    """Multimodal checkpoints nest the decoder under text_config; --dtype casts."""
    hf = as_hf_checkpoint(source, tmp_path / "hf", shards=3)
    text = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text}))
    assert main(["import", str(hf), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    manifest = read_manifest(tmp_path / "out")
    assert manifest.dtype == "bfloat16" and manifest.model_id == "hf"
    out = logits(tmp_path / "out")
    assert mx.allclose(out, logits(source), atol=0.5).item()  # bfloat16 weights, same model


def test_unknown_model_type_lists_the_installed_families(source: Path, tmp_path: Path) -> None:
    hf = as_hf_checkpoint(source, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(FamilyNotFound, match=r"'llama'.*gemma4 \(gemma4_text\)"):
        import_checkpoint(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_config_that_does_not_fit_the_family_is_refused_by_field(
    source: Path, tmp_path: Path
) -> None:
    hf = as_hf_checkpoint(source, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    del config["hidden_size"]
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(InstallError, match="hidden_size"):
        import_checkpoint(hf, tmp_path / "out", progress=False)


def test_an_existing_install_is_never_overwritten(source: Path, tmp_path: Path) -> None:
    hf = as_hf_checkpoint(source, tmp_path / "hf")
    with pytest.raises(InstallError, match="not empty"):
        import_checkpoint(hf, source, progress=False)
    assert read_manifest(source).model_id == "src"


def test_a_multimodal_gemma4_checkpoint_imports_its_text_decoder(
    source: Path, tmp_path: Path
) -> None:
    """Gemma 4 releases name the decoder ``model.language_model.*`` beside vision
    and audio towers, under a nested config: the import serves the decoder."""
    hf = as_hf_checkpoint(source, tmp_path / "hf", shards=1)
    text = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text}))
    for file in hf.glob("model-*.safetensors"):
        weights = mx.load(str(file))
        renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
        renamed["model.vision_tower.patch_embed.weight"] = mx.zeros((4, 4))
        mx.save_safetensors(str(file), renamed, metadata={"format": "pt"})
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        k.replace("model.", "model.language_model.", 1): v for k, v in index["weight_map"].items()
    }
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    import_checkpoint(hf, tmp_path / "out", model_id="mm", progress=False)
    assert mx.array_equal(logits(tmp_path / "out"), logits(source))
