"""Serving what the user has: a plain checkpoint directory (ours without its
manifest, or one ``mlx_lm.convert`` wrote) or a Hugging Face hub id computes
what the install computes; verification is done once and remembered outside the
directory (an install's as well as a checkpoint's), a changed file is detected,
and sessions saved against other weights are refused."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from serving import client, serve_process, serving

from helpers import serve_turn
from turbospark.cli import main
from turbospark.conformance.kit import FamilyKit
from turbospark.errors import InstallError
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.loading import sources
from turbospark.loading.install import MANIFEST, read_manifest
from turbospark.loading.sources import record_path, resolve_source
from turbospark.sessions.session_file import ModelIdentity
from turbospark.text import load_text

PROMPT = [1, 3, 40, 41, 42, 9, 17, 100, 6, 8, 11, 12]
CONVERSATION = [1, 3, *range(40, 60)]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every record in this test's own cache, never the user's."""
    root = tmp_path / "turbospark-cache"
    monkeypatch.setenv("TURBOSPARK_CACHE", str(root))
    return root


def plain_copy(install: Path, out: Path) -> Path:
    """The install as a plain checkpoint directory: the same files, no manifest."""
    shutil.copytree(install, out)
    (out / MANIFEST).unlink()
    return out


@pytest.fixture
def plain(qwen_gdn_install: Path, tmp_path: Path) -> Path:
    return plain_copy(qwen_gdn_install, tmp_path / "tiny-plain")


def logits(model: str | Path) -> mx.array:
    return Runner.open(model, context_length=64).prefill_chunk(PROMPT, 0)


def perturb_weights(directory: Path) -> None:
    """Rewrite model.safetensors with one tensor changed (same size, new mtime)."""
    file = directory / "model.safetensors"
    weights = dict(mx.load(str(file)))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1
    stat = file.stat()
    mx.save_safetensors(str(file), weights, metadata={"format": "pt"})
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def never_hash(path: Path, chunk: int = 0) -> str:
    raise AssertionError(f"{path} was hashed again")


def test_a_plain_directory_computes_the_install_logits(qwen_gdn_install, plain, cache):
    runner = Runner.open(plain, context_length=64)
    assert runner.source.kind == "checkpoint" and runner.source.path == plain
    installed = read_manifest(qwen_gdn_install)
    # The same files hash the same: the synthesized manifest is the install's, bar the id.
    assert runner.manifest.files == installed.files and runner.manifest.arch == installed.arch
    assert runner.manifest.model_id == "tiny-plain" and runner.manifest.dtype == installed.dtype
    assert mx.array_equal(runner.prefill_chunk(PROMPT, 0), logits(qwen_gdn_install))
    assert record_path(plain).is_relative_to(cache)  # remembered outside the directory
    assert sorted(p.name for p in plain.iterdir()) == sorted(
        p.name for p in qwen_gdn_install.iterdir() if p.name != MANIFEST
    )


def test_a_directory_written_by_mlx_lm_convert_computes_the_install_logits(
    qwen_gdn_install, tmp_path
):
    from mlx_lm import convert

    out = tmp_path / "converted"
    convert(str(qwen_gdn_install), mlx_path=str(out), dtype="float32")
    assert not (out / MANIFEST).exists()
    source = resolve_source(out)
    assert source.kind == "checkpoint" and source.manifest.family == "qwen_gdn"
    assert mx.array_equal(logits(out), logits(qwen_gdn_install))


def test_a_second_open_hashes_nothing(plain, monkeypatch):
    first = resolve_source(plain, progress=False)
    monkeypatch.setattr(sources, "sha256_file", never_hash)
    again = resolve_source(plain, progress=False)
    assert again.manifest == first.manifest
    Runner.open(plain, context_length=64)  # the runner verifies nothing twice either


def test_a_changed_file_is_detected_rehashed_and_recorded(plain, monkeypatch, caplog):
    before = resolve_source(plain, progress=False).manifest
    perturb_weights(plain)
    with caplog.at_level(logging.WARNING, logger="turbospark.loading.sources"):
        after = resolve_source(plain, progress=False).manifest
    assert "model.safetensors (changed) since it was verified" in caplog.text
    digest = hashlib.sha256((plain / "model.safetensors").read_bytes()).hexdigest()
    assert after.files["model.safetensors"].sha256 == digest != before.files["model.safetensors"]
    assert after.files["config.json"] == before.files["config.json"]
    monkeypatch.setattr(sources, "sha256_file", never_hash)
    assert resolve_source(plain, progress=False).manifest == after  # the record was updated


def test_an_added_or_removed_file_is_detected(plain, caplog):
    resolve_source(plain, progress=False)
    (plain / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    with caplog.at_level(logging.WARNING, logger="turbospark.loading.sources"):
        added = resolve_source(plain, progress=False).manifest
        (plain / "chat_template.jinja").unlink()
        removed = resolve_source(plain, progress=False).manifest
    assert "chat_template.jinja (added)" in caplog.text
    assert "chat_template.jinja (removed)" in caplog.text
    assert "chat_template.jinja" in added.files and "chat_template.jinja" not in removed.files


def installed_copy(install: Path, out: Path) -> Path:
    shutil.copytree(install, out)
    return out


def test_an_install_is_hashed_once_then_trusted_by_size_and_mtime(
    qwen_gdn_install, tmp_path, monkeypatch
):
    path = installed_copy(qwen_gdn_install, tmp_path / "install")
    first = Runner.open(path, context_length=64).prefill_chunk(PROMPT, 0)
    monkeypatch.setattr(sources, "sha256_file", never_hash)
    again = Runner.open(path, context_length=64).prefill_chunk(PROMPT, 0)
    assert mx.array_equal(first, again)


def test_an_install_changed_after_its_record_is_hashed_again_and_refused(
    qwen_gdn_install, tmp_path
):
    path = installed_copy(qwen_gdn_install, tmp_path / "install")
    Runner.open(path, context_length=64)
    file = path / "model.safetensors"
    data, stat = bytearray(file.read_bytes()), file.stat()
    data[-1] ^= 0xFF  # same size, new mtime: the record no longer vouches for it
    file.write_bytes(bytes(data))
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(InstallError, match=r"model\.safetensors sha256 mismatch"):
        Runner.open(path, context_length=64)
    with pytest.raises(InstallError, match="sha256 mismatch"):  # refused again, never recorded
        Runner.open(path, context_length=64)


def test_a_manifest_naming_other_hashes_is_checked_again_despite_the_record(
    qwen_gdn_install, tmp_path
):
    path = installed_copy(qwen_gdn_install, tmp_path / "install")
    Runner.open(path, context_length=64)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["model.safetensors"]["sha256"] = "0" * 64  # sizes and mtimes unchanged
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(InstallError, match=r"model\.safetensors sha256 mismatch"):
        Runner.open(path, context_length=64)


def test_sessions_saved_against_other_weights_are_refused(plain, tmp_path):
    saved = tmp_path / "sessions"
    runner = Runner.open(plain, session_slots=2, session_dir=saved)
    runner.set_prefix_reuse(True)
    serve_turn(runner, CONVERSATION)
    runner.close()
    (file,) = saved.glob("*.safetensors")
    perturb_weights(plain)
    changed = Runner.open(plain, session_slots=2, session_dir=saved)
    changed.set_prefix_reuse(True)
    assert changed.session_disk.rejected == [(file.name, "foreign")]
    assert ModelIdentity.of(changed.manifest, changed.dtype, None) != ModelIdentity.of(
        runner.manifest, runner.dtype, None
    )
    prompt = [*CONVERSATION, 5]
    kept, got = serve_turn(changed, prompt)
    assert kept == 0, changed.last_reuse  # prefilled from scratch, on the new weights
    fresh = Runner.open(plain).prefill_chunk(prompt, 0)
    assert mx.allclose(got, fresh, atol=1e-5)


def test_what_is_not_a_model_is_refused_in_one_line(plain, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        empty: "neither manifest.json (an install) nor config.json",
        tmp_path / "no" / "such" / "dir": "no such directory, and not a Hugging Face repo id",
    }
    (tmp_path / "file.txt").write_text("x")
    cases[tmp_path / "file.txt"] = "is a file; pass the directory"
    for path, message in cases.items():
        with pytest.raises(InstallError) as excinfo:
            resolve_source(path)
        assert message in str(excinfo.value) and "\n" not in str(excinfo.value)
    shutil.copy(plain / "config.json", empty)
    with pytest.raises(
        InstallError, match=r"no \.safetensors files in .*not a servable checkpoint"
    ):
        resolve_source(empty)
    assert main(["generate", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pass an install, a checkpoint directory or a hub id" in err and "\n" not in err


def hub_cache(root: Path, repo_id: str, checkpoint: Path) -> Path:
    """*checkpoint* laid out as huggingface_hub caches a download: blobs named by
    hash, a snapshot of symlinks to them, and refs/main naming the commit."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in checkpoint.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, repo / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hf-hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_a_hub_id_resolves_offline_from_the_cache(
    qwen_gdn_install, plain, offline_hub, tmp_path, monkeypatch
):
    snapshot = hub_cache(offline_hub, "tiny-org/tiny-qwen", plain)
    source = resolve_source("tiny-org/tiny-qwen", progress=False)
    assert source.kind == "hub" and source.path == snapshot
    assert source.manifest.model_id == "tiny-org/tiny-qwen"
    assert source.describe() == f"hub id tiny-org/tiny-qwen ({snapshot})"
    assert mx.array_equal(logits("tiny-org/tiny-qwen"), logits(qwen_gdn_install))
    by_path = resolve_source(snapshot, progress=False)  # the snapshot named by its path
    assert by_path.kind == "checkpoint" and by_path.manifest == source.manifest
    # A local path wins over an id.
    monkeypatch.chdir(tmp_path)
    plain_copy(qwen_gdn_install, tmp_path / "tiny-org" / "tiny-qwen")
    local = resolve_source("tiny-org/tiny-qwen", progress=False)
    assert local.kind == "checkpoint" and local.path == Path("tiny-org/tiny-qwen")


def test_an_unknown_hub_id_offline_is_refused_by_name(offline_hub):
    with pytest.raises(InstallError) as excinfo:
        resolve_source("tiny-org/not-downloaded")
    message = str(excinfo.value)
    assert message.startswith("tiny-org/not-downloaded: not a local directory and not in the")
    assert "HF_HUB_OFFLINE is set" in message and "\n" not in message


def test_the_server_on_a_plain_directory_answers_a_chat(qwen_gdn_install, plain):
    codec = load_text(plain)
    messages = [{"role": "user", "content": "Name a colour."}]
    config = GenerationConfig(max_tokens=6)
    expected = generate(Runner.open(qwen_gdn_install), codec, codec.encode_chat(messages), config)
    with serving(plain, codec, slots=1) as running:
        reply = client(running).chat.completions.create(
            model="tiny-plain", messages=messages, max_tokens=6, temperature=0
        )
    assert reply.model == "tiny-plain"
    message = reply.choices[0].message  # the synthetic Qwen template thinks by default
    said = (getattr(message, "reasoning_content", None) or "") + (message.content or "")
    assert said == expected.text


@pytest.mark.slow
def test_serve_names_what_it_opened(plain):
    with serve_process(plain, "--no-warm-up", family="qwen_gdn") as (process, base):
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = api.chat.completions.create(
            model="tiny-plain", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == "tiny-plain"
    output = process.stdout.read()  # the process is gone: its pipe drains to the end
    assert f"serving tiny-plain (qwen_gdn, float32, checkpoint {plain}) on http://" in output


def test_the_kit_takes_a_plain_directory(qwen_gdn_install, plain):
    kit = FamilyKit.create("qwen_gdn", plain)
    installed = FamilyKit.create("qwen_gdn", qwen_gdn_install)
    assert kit.source.kind == "checkpoint" and kit.install == plain
    assert kit.arch == installed.arch and set(kit.weights) == set(installed.weights)
    assert mx.array_equal(kit.open().prefill_chunk(PROMPT, 0), logits(qwen_gdn_install))
