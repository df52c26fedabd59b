"""``turbospark steer extract`` and the ``--steering`` flags, through the CLI's own entry."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from test_steering import write_gguf

from turbospark import Runner, build_synthetic_install
from turbospark.cli import main
from turbospark.policies.steering import SteeringPolicy
from turbospark.text import load_text

POSITIVE = ["I love this, it is wonderful", "What a delight", "Happy days are here"]
NEGATIVE = ["I hate this, it is awful", "What a disaster", "Sad days are here"]


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("steer-cli")
    build_synthetic_install("qwen_gdn", path, vocab_size=128, num_layers=4, model_id="steer-cli")
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prompts")
    (root / "pos.txt").write_text("\n".join(POSITIVE) + "\n")
    (root / "neg.txt").write_text("\n\n".join(NEGATIVE))  # blank lines are skipped
    return root / "pos.txt", root / "neg.txt"


def extract(install: Path, prompts: tuple[Path, Path], out: Path, *extra: str) -> int:
    pos, neg = prompts
    args = ["steer", "extract", str(install), "--positive", str(pos), "--negative", str(neg)]
    return main([*args, "--out", str(out), "--raw", "--json", *extra])


def test_extract_mean_writes_llama_cpp_format(install, prompts, tmp_path, capsys):
    """The difference of the means of last-token states at each layer's output, in
    a file that reads back exactly like one gguf's writer wrote independently."""
    out = tmp_path / "vec.gguf"
    assert extract(install, prompts, out) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["layers"] == [1, 3] and summary["pairs"] == 3
    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.architecture").contents() == "controlvector"
    written = {t.name: np.array(t.data) for t in reader.tensors}
    assert sorted(written) == ["direction.1", "direction.2", "direction.3"]

    runner, codec = Runner.open(install), load_text(install)
    states = {
        side: [runner.layer_outputs(codec.encode(p, add_special_tokens=True)) for p in texts]
        for side, texts in (("pos", POSITIVE), ("neg", NEGATIVE))
    }
    for k in (1, 2, 3):
        expected = np.mean([np.array(s[k]) for s in states["pos"]], 0) - np.mean(
            [np.array(s[k]) for s in states["neg"]], 0
        )
        np.testing.assert_allclose(written[f"direction.{k}"], expected, rtol=1e-4, atol=1e-5)
    theirs = write_gguf(
        tmp_path / "theirs.gguf", {int(n.split(".")[1]): v for n, v in written.items()}
    )
    assert SteeringPolicy.from_gguf(out) == SteeringPolicy.from_gguf(theirs)


def test_extract_pca_on_a_layer_range(install, prompts, tmp_path, capsys):
    out = tmp_path / "pca.gguf"
    assert extract(install, prompts, out, "--method", "pca", "--layers", "2:3") == 0
    norms = json.loads(capsys.readouterr().out)["norms"]
    assert sorted(norms) == ["2", "3"] and all(abs(n - 1) < 1e-4 for n in norms.values())
    assert sorted(SteeringPolicy.from_gguf(out).directions) == [2, 3]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layers", "1:4"], "outside the model"),
        (["--layers", "0:2"], "numbered from 1"),
    ],
)
def test_extract_refuses_bad_input_in_one_line(install, prompts, tmp_path, capsys, extra, message):
    assert extract(install, prompts, tmp_path / "x.gguf", *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "x.gguf").exists()


def test_extract_refuses_unpaired_prompts(install, prompts, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("only one\n")
    assert extract(install, (prompts[0], short), tmp_path / "x.gguf") == 2
    assert "paired line by line" in capsys.readouterr().err


def generate(install: Path, *flags: str) -> dict:
    args = ["generate", str(install), "--prompt", "hello", "--raw", "--max-tokens", "6", "--json"]
    return main([*args, *flags])


def test_generate_steering_flags(install, prompts, tmp_path, capsys):
    """Scale 0 generates what no steering does; a strong vector changes the text."""
    out = tmp_path / "vec.gguf"
    assert extract(install, prompts, out) == 0
    capsys.readouterr()
    results = {}
    for name, flags in {
        "off": [],
        "zero": ["--steering", str(out), "--steering-scale", "0"],
        "strong": ["--steering", str(out), "--steering", str(out), "--steering-scale", "50"],
    }.items():
        assert generate(install, *flags) == 0
        results[name] = json.loads(capsys.readouterr().out)["tokens"]
    assert results["zero"] == results["off"]
    assert results["strong"] != results["off"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steering-scale", "2"], "need a vector"),
        (["--steering", "{vec}", "--steering-mode", "sideways"], "unknown steering mode"),
        (["--steering", "{vec}", "--steering-layers", "1:9"], "outside the model"),
        (["--steering", "{vec}", "--steering-scale", "nan"], "finite"),
    ],
)
def test_generate_refuses_bad_steering_in_one_line(install, tmp_path, capsys, flags, message):
    vec = write_gguf(tmp_path / "v.gguf", {1: np.ones(Runner.open(install).arch.hidden_size)})
    assert generate(install, *[f.format(vec=vec) for f in flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
