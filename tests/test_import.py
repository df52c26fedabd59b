"""``turbospark import``: Hugging Face shards -> an install that computes the same logits."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from turbospark import build_synthetic_install, peek_manifest_arch
from turbospark.cli import main
from turbospark.errors import FamilyNotFound, InstallError
from turbospark.generation.runner import Runner
from turbospark.loading.importer import import_checkpoint
from turbospark.loading.install import MANIFEST, read_manifest, tensor_names
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


# -- checkpoints as transformers writes them (tests/fixtures/hf_reference) -------------

HF_REFERENCE = Path(__file__).parent / "fixtures" / "hf_reference"
FIXTURES = ("gemma4_dense", "gemma4_moe", "gemma4_release", "qwen3_5_text", "qwen3_5_release")


def fixture_copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(HF_REFERENCE / name, tmp_path / name))


def edit_config(hf: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    config = json.loads((hf / "config.json").read_text())
    edit(config)
    (hf / "config.json").write_text(json.dumps(config))


def edit_weights(hf: Path, edit: Callable[[dict[str, mx.array]], object]) -> None:
    weights = mx.load(str(hf / "model.safetensors"))
    edit(weights)
    mx.save_safetensors(str(hf / "model.safetensors"), weights, metadata={"format": "pt"})


def refused(hf: Path, out: Path, error: type[Exception] = InstallError) -> str:
    """The one-line refusal of importing *hf*; nothing may be written to *out*."""
    with pytest.raises(error) as caught:
        import_checkpoint(hf, out, progress=False)
    assert not out.exists()
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", FIXTURES)
def test_fixtures_are_small_and_say_what_made_them(name: str) -> None:
    files = list((HF_REFERENCE / name).iterdir())
    assert sum(f.stat().st_size for f in files) < 700 * 1024
    versions = json.loads((HF_REFERENCE / name / "generator.json").read_text())
    assert {"torch", "transformers", "safetensors", "python"} <= set(versions)


def test_an_explicit_null_stays_null_and_the_manifest_agrees(tmp_path: Path) -> None:
    """transformers writes ``final_logit_softcapping: null`` and the full layers'
    head dim only under ``per_layer_config``; neither may become our default."""
    manifest = import_checkpoint(HF_REFERENCE / "gemma4_dense", tmp_path / "out", progress=False)
    assert manifest.arch["final_logit_softcapping"] is None
    arch = peek_manifest_arch(tmp_path / "out")  # read from config.json, checked against manifest
    assert arch.final_logit_softcapping is None
    assert [arch.layer_head_dim(i) for i in range(4)] == [16, 32, 16, 32]


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_5_release"])
def test_qwen3_5_text_model_types_import(name: str, tmp_path: Path) -> None:
    manifest = import_checkpoint(HF_REFERENCE / name, tmp_path / "out", progress=False)
    assert manifest.family == "qwen_gdn" and manifest.arch["model_type"] == "qwen3_5_text"


def test_a_manifest_that_disagrees_with_config_json_is_refused(tmp_path: Path) -> None:
    import_checkpoint(HF_REFERENCE / "gemma4_dense", tmp_path / "out", progress=False)
    file = tmp_path / "out" / MANIFEST
    manifest = json.loads(file.read_text())
    manifest["arch"]["final_logit_softcapping"] = 30.0  # what the old import recorded
    file.write_text(json.dumps(manifest))
    with pytest.raises(InstallError, match=r"arch.final_logit_softcapping=30.0 but config.json"):
        Runner.open(tmp_path / "out")


def test_an_impossible_config_value_is_refused_by_field(tmp_path: Path) -> None:
    hf = fixture_copy("gemma4_dense", tmp_path)
    edit_config(hf, lambda c: c.update(num_attention_heads=0))
    assert "num_attention_heads" in refused(hf, tmp_path / "out")


def test_a_missing_tensor_is_refused_by_name(tmp_path: Path) -> None:
    hf = fixture_copy("qwen3_5_text", tmp_path)
    edit_weights(hf, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    assert "model.layers.1.self_attn.k_proj.weight" in refused(hf, tmp_path / "out")


def test_a_mis_shaped_tensor_is_refused_with_both_shapes(tmp_path: Path) -> None:
    hf = fixture_copy("qwen3_5_text", tmp_path)
    edit_weights(
        hf, lambda w: w.update({"model.layers.0.mlp.down_proj.weight": mx.zeros((64, 31))})
    )
    assert refused(hf, tmp_path / "out") == (
        "tensor model.layers.0.mlp.down_proj.weight has shape (64, 31), config.json implies "
        "(64, 32); the checkpoint does not match its config"
    )


def test_a_config_that_misreads_its_tensors_fails_at_import_not_at_open(tmp_path: Path) -> None:
    """Without per_layer_config the full layers' head dim falls back to 512."""
    hf = fixture_copy("gemma4_dense", tmp_path)
    edit_config(hf, lambda c: c.pop("per_layer_config"))
    message = refused(hf, tmp_path / "out")
    assert re.fullmatch(
        r"tensor model\.layers\.[13]\.self_attn\.\S+ has shape \(.*\), "
        r"config\.json implies \(.*\); the checkpoint does not match its config",
        message,
    ), message


@pytest.mark.parametrize(
    ("name", "edit", "fields"),
    [
        (
            "qwen3_5_release",
            lambda c: c["text_config"].update(tie_word_embeddings=True),
            ("tie_word_embeddings=false", "text_config.tie_word_embeddings=true"),
        ),
        (
            "gemma4_dense",
            lambda c: c.update(global_head_dim=64),
            ("global_head_dim=64", "per_layer_config.1.head_dim=32"),
        ),
        (
            "qwen3_5_text",
            lambda c: c.update(full_attention_interval=4),
            ("layer_types", "full_attention_interval=4"),
        ),
    ],
)
def test_conflicting_duplicated_fields_are_refused_by_both_names(
    name: str, edit: Callable[[dict[str, Any]], object], fields: tuple[str, str], tmp_path: Path
) -> None:
    hf = fixture_copy(name, tmp_path)
    edit_config(hf, edit)
    message = refused(hf, tmp_path / "out")
    assert all(field in message for field in fields), message


def test_an_unknown_model_type_names_the_families_and_the_override(tmp_path: Path) -> None:
    hf = fixture_copy("qwen3_5_text", tmp_path)
    edit_config(hf, lambda c: c.update(model_type="llama"))
    message = refused(hf, tmp_path / "out", FamilyNotFound)
    assert "'llama'" in message and "qwen_gdn" in message and "--family" in message


def test_a_qwen3_5_checkpoint_with_an_mtp_head_keeps_it(tmp_path: Path) -> None:
    """mlx-lm drops ``mtp.*``; the import keeps it, so DraftPolicies.mtp can draft
    with it, and mlx-lm still loads the install (its sanitize drops the head)."""
    from turbospark.policies import DraftPolicies

    src = tmp_path / "src"
    build_synthetic_install("qwen_gdn", src, vocab_size=128, num_layers=4, mtp=True)
    hf = as_hf_checkpoint(src, tmp_path / "hf")
    manifest = import_checkpoint(hf, tmp_path / "out", progress=False)
    assert any(name.startswith("mtp.") for name in tensor_names(tmp_path / "out", manifest))
    out = Runner.open(tmp_path / "out", context_length=64, draft=DraftPolicies.mtp())
    assert out.mtp_head is not None
    assert mx.array_equal(logits(tmp_path / "out"), logits(src))
    load_model(tmp_path / "out")
