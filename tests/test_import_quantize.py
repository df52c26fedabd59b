"""``turbospark import --quantize``: the checkpoint mlx-lm's converter would write.

Our converter quantizes the model the family loaded and saves its parameters;
mlx-lm loads the result with exactly the tensors ``mlx_lm.convert -q`` writes
from the same floating-point install (bit for bit), and a checkpoint mlx-lm
wrote imports unchanged. Refusals name the flag that fixes them and leave
nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from quantized_checkpoints import mlx_lm_convert, mlx_lm_parameters, our_convert, source

from turbospark import build_synthetic_install
from turbospark.cli import main
from turbospark.errors import InstallError
from turbospark.loading.convert import requested_spec
from turbospark.loading.importer import import_checkpoint
from turbospark.loading.install import load_weights, read_manifest
from turbospark.loading.quantization import Quantization, QuantSpec


def _block(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"]
    return config["quantization"]


@pytest.mark.parametrize(
    ("name", "bits", "group"),
    [
        ("gemma4", 4, 32),
        ("gemma4", 8, 64),
        ("gemma4_moe", 4, 32),
        ("gemma4_moe", 8, 64),
        ("qwen_gdn", 4, 64),
        ("qwen_gdn", 8, 32),
        ("qwen_gdn_tied", 4, 32),
    ],
)
def test_our_checkpoint_is_the_one_mlx_lm_writes(
    name: str, bits: int, group: int, tmp_path: Path
) -> None:
    """Same tensors, same dtypes, as mlx-lm loads both; the same default block,
    ours also naming each module kept in floating point."""
    src = source(name, tmp_path / "src")
    spec = QuantSpec(bits=bits, group_size=group)
    ours = our_convert(src, tmp_path / "ours", spec)
    theirs = mlx_lm_convert(src, tmp_path / "theirs", spec)
    got, expected = mlx_lm_parameters(ours), mlx_lm_parameters(theirs)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and mx.array_equal(got[key], value).item(), key
    block, reference = _block(ours), _block(theirs)
    mine = Quantization.from_config({"quantization": block})
    upstream = Quantization.from_config({"quantization": reference})
    assert mine is not None and upstream is not None and mine.default == upstream.default
    assert {k: mine.overrides[k] for k in upstream.overrides} == upstream.overrides
    kept = [path for path, value in block.items() if value is False]
    assert all(f"{path}.scales" not in got and f"{path}.weight" in load_weights(
        ours, read_manifest(ours)
    ) for path in kept)  # fmt: skip


@pytest.mark.parametrize("name", ["gemma4_moe", "qwen_gdn"])
@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_the_microscaling_modes_write_what_mlx_lm_writes(
    name: str, mode: str, tmp_path: Path
) -> None:
    src = source(name, tmp_path / "src")
    spec = requested_spec(8 if mode == "mxfp8" else 4, None, mode)
    got = mlx_lm_parameters(our_convert(src, tmp_path / "ours", spec))
    expected = mlx_lm_parameters(mlx_lm_convert(src, tmp_path / "theirs", spec))
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and mx.array_equal(got[key], value).item(), key


def test_gemma4_keeps_its_router_at_8_bits_as_mlx_lm_does(tmp_path: Path) -> None:
    src = source("gemma4_moe", tmp_path / "src")
    spec = QuantSpec(bits=4, group_size=32)
    ours, theirs = (
        our_convert(src, tmp_path / "ours", spec),
        mlx_lm_convert(src, tmp_path / "theirs", spec),
    )
    routers = {k: v for k, v in _block(theirs).items() if k.endswith("router.proj")}
    assert routers and all(v == {"group_size": 64, "bits": 8} for v in routers.values())
    mine = Quantization.from_config(json.loads((ours / "config.json").read_text()))
    assert mine is not None
    assert {k: mine.overrides[k] for k in routers} == dict.fromkeys(
        routers, QuantSpec(bits=8, group_size=64)
    )
    weights = load_weights(ours, read_manifest(ours))
    router = next(iter(routers))
    assert weights[f"{router}.weight"].dtype == mx.uint32
    assert (
        weights[f"{router}.weight"].shape[-1] * 32 // 8
        == weights[f"{router}.scales"].shape[-1] * 64
    )


def test_a_checkpoint_mlx_lm_quantized_imports_unchanged(tmp_path: Path) -> None:
    src = source("gemma4", tmp_path / "src")
    theirs = mlx_lm_convert(src, tmp_path / "theirs", QuantSpec(bits=4, group_size=64))
    manifest = import_checkpoint(theirs, tmp_path / "out", progress=False)
    written = load_weights(tmp_path / "out", manifest)
    original = mx.load(str(theirs / "model.safetensors"))
    assert written.keys() == original.keys()
    assert all(mx.array_equal(written[k], v).item() for k, v in original.items())
    assert _block(tmp_path / "out") == _block(theirs)


def test_quantizing_a_quantized_checkpoint_is_refused(tmp_path: Path) -> None:
    src = source("qwen_gdn", tmp_path / "src")
    theirs = mlx_lm_convert(src, tmp_path / "theirs", QuantSpec(bits=8, group_size=64))
    with pytest.raises(
        InstallError, match=r"already quantized \(8-bit affine, group 64\).*without --quantize"
    ):
        import_checkpoint(
            theirs, tmp_path / "out", quantize=QuantSpec(bits=4, group_size=64), progress=False
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((7, None, "affine"), r"--quantize 7: affine quantization packs 2, 3, 4, 5, 6, 8 bits"),
        ((4, 48, "affine"), r"--group-size 48 is not one MLX packs; pass one of 32, 64, 128"),
        ((8, None, "mxfp4"), r"--mode mxfp4 packs 4 bits in groups of 32; pass --quantize 4"),
        ((4, 32, "nvfp4"), r"--mode nvfp4 packs 4 bits in groups of 16.*leave out --group-size"),
    ],
)
def test_settings_mlx_cannot_pack_are_refused_naming_the_fix(
    args: tuple[int, int | None, str], message: str
) -> None:
    with pytest.raises(InstallError, match=message):
        requested_spec(*args)


def test_the_microscaling_modes_take_their_fixed_group() -> None:
    assert requested_spec(4, None, "mxfp4") == QuantSpec(bits=4, group_size=32, mode="mxfp4")
    assert requested_spec(8, None, "mxfp8") == QuantSpec(bits=8, group_size=32, mode="mxfp8")
    assert requested_spec(4) == QuantSpec(bits=4, group_size=64)  # mlx_lm.convert's default


def test_a_group_size_that_divides_no_module_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    build_synthetic_install("gemma4", src, vocab_size=128, global_head_dim=16)  # widths 16, 64, 96
    with pytest.raises(InstallError, match=r"group size 128 divides the input width of no module"):
        import_checkpoint(
            src, tmp_path / "out", quantize=QuantSpec(bits=4, group_size=128), progress=False
        )
    assert not (tmp_path / "out").exists()


def test_a_quantized_synthetic_install_is_the_converters_output(tmp_path: Path) -> None:
    dims = {"vocab_size": 128, "num_layers": 4, "seed": 2}
    spec = QuantSpec(bits=4, group_size=32)
    build_synthetic_install("qwen_gdn", tmp_path / "src", **dims)
    import_checkpoint(tmp_path / "src", tmp_path / "imported", quantize=spec, progress=False)
    build_synthetic_install("qwen_gdn", tmp_path / "built", quantize=spec, **dims)
    built = load_weights(tmp_path / "built", read_manifest(tmp_path / "built"))
    imported = load_weights(tmp_path / "imported", read_manifest(tmp_path / "imported"))
    assert built.keys() == imported.keys()
    assert all(mx.array_equal(built[k], v).item() for k, v in imported.items())
    assert _block(tmp_path / "built") == _block(tmp_path / "imported")


def test_the_cli_quantizes_and_families_reads_the_block_without_the_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = source("qwen_gdn", tmp_path / "src")
    out = tmp_path / "out"
    args = ["import", str(src), str(out), "--quantize", "4", "--group-size", "32", "--json"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["quantization"] == _block(out) and printed["family"] == "qwen_gdn"
    for name in read_manifest(out).weight_files:
        (out / name).unlink()  # families must not need them
    assert main(["families", str(out)]) == 0
    assert (
        f"install {out}: src (qwen_gdn, float32, 4-bit affine, group 32" in capsys.readouterr().out
    )
    assert main(["families", str(out), "--json"]) == 0
    (described,) = json.loads(capsys.readouterr().out)["installs"]
    assert described["quantization"] == printed["quantization"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--group-size", "32"], "--group-size and --mode apply with --quantize BITS; add it"),
        (["--quantize", "3", "--mode", "mxfp8"], "--mode mxfp8 packs 8 bits in groups of 32"),
    ],
)
def test_cli_refusals_are_one_line_and_write_nothing(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = source("qwen_gdn", tmp_path / "src")
    assert main(["import", str(src), str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_families_describes_a_checkpoint_mlx_lm_wrote_as_it_lies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = source("gemma4_moe", tmp_path / "src")
    theirs = mlx_lm_convert(src, tmp_path / "theirs", QuantSpec(bits=4, group_size=32))
    assert main(["families", str(theirs)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == (
        f"checkpoint {theirs}: theirs (gemma4, float32, mixed 4/8-bit: "
        "27 modules 4-bit affine, group 32; 2 modules 8-bit affine, group 64)"
    )


def test_families_names_a_directory_that_is_no_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["families", str(tmp_path)]) == 2
    assert "is not a turbospark install" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_names_the_packing_it_loaded_and_answers_the_openai_client(tmp_path: Path) -> None:
    import openai
    from serving import serve_process

    install = tmp_path / "install"
    build_synthetic_install("qwen4_exp", install, quantize=QuantSpec(bits=4, group_size=32))
    with serve_process(install, "--no-warm-up", family="qwen4_exp") as (process, base):
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        model = api.models.list().data[0].id
        reply = api.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        process.kill()
        printed = process.communicate()[0]
    assert f"(qwen4_exp, float32, 4-bit affine, group 32, install {install})" in printed
