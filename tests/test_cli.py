"""The CLI through its own entry point: families, demo, allowlist, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from turbospark.cli import main
from turbospark.loading.plugins import FamilyRegistry


def test_families_json_lists_every_builtin_with_capabilities(capsys):
    assert main(["families", "--json"]) == 0
    listed = {f["name"]: f for f in json.loads(capsys.readouterr().out)["families"]}
    assert set(listed) == {"gemma4", "qwen_gdn", "qwen4_exp"}
    gdn = {c["name"]: c for c in listed["qwen_gdn"]["components"]}
    assert gdn["gdn"]["swappable"] and gdn["gdn"]["rewindable"] is False
    window = {c["name"]: c for c in listed["gemma4"]["components"]}["window"]
    assert window["rewindable"] == "window"
    # Every built-in decodes concurrent requests in one forward, qwen4_exp's five components too.
    assert {name: f["batched_decode"] for name, f in listed.items()} == dict.fromkeys(listed, True)
    assert all(c["batchable"] for c in listed["qwen4_exp"]["components"])


def test_families_text_output_names_components(capsys):
    assert main(["families"]) == 0
    out = capsys.readouterr().out
    assert "qwen4_exp" in out and "ple_conv_tail" in out and "not swappable" in out
    qwen4 = out[out.index("qwen4_exp  (") :].split("\n")[1]
    assert qwen4.strip() == "concurrent requests decode batched (one forward per step)"


def test_the_allowlist_filters_and_disables_plugins():
    assert set(FamilyRegistry.discover(allow="gemma4").families) == {"gemma4"}
    none = FamilyRegistry.discover(allow="none")
    assert none.families == {}
    assert "no family plugins are installed" in none.describe_installed()


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_demo_runs_both_modes_and_the_pool_prefills_less(family, tmp_path, capsys, monkeypatch):
    """gemma4 names its cache directory, qwen_gdn takes turbospark's."""
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path / "cache"))
    where = ["--cache-dir", str(tmp_path)] if family == "gemma4" else []
    args = [
        "demo",
        "--family",
        family,
        "--conversations",
        "2",
        "--turns",
        "3",
        "--turn-tokens",
        "24",
    ]
    assert main([*args, "--reply-tokens", "2", *where, "--json"]) == 0
    turns = json.loads(capsys.readouterr().out)
    built = tmp_path / ("demo" if where else "cache/demo")
    assert [p.name.split("-")[0] for p in built.iterdir()] == [family]
    prefilled = {
        mode: sum(t["prefilled"] for t in turns if t["mode"] == mode)
        for mode in ("pool", "no-pool")
    }
    assert prefilled["pool"] < prefilled["no-pool"]
    later = [t for t in turns if t["mode"] == "pool" and t["turn"] > 0]
    assert all(t["reason"] == "extends" and t["swapped"] for t in later)
    assert not any(t["evicted"] for t in turns)


def test_a_refusal_prints_one_line_and_exits_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither manifest.json (an install) nor config.json" in err[0]


def test_python_dash_m_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "turbospark", "--help"], capture_output=True, text=True, check=True
    )
    for command in ("demo", "families", "serve", "generate", "chat", "import", "conformance"):
        assert command in done.stdout


HEAVY = {"uvicorn", "starlette", "pytest", "hypothesis"}


def imported_by(*argv: str) -> set[str]:
    """Top-level packages a fresh interpreter has imported after running the CLI."""
    code = (
        "import sys\n"
        "from turbospark.cli import main\n"
        "try:\n"
        f"    main({list(argv)!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('MODULES', *sorted({m.split('.')[0] for m in sys.modules}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("MODULES ")]
    return set(line.split()[1:])


def test_help_and_families_load_no_web_server_and_no_test_kit():
    """The lean core: the server and the conformance extra load only where used."""
    help_loads = imported_by("--help")
    assert not help_loads & (HEAVY | {"mlx", "turbospark_gemma4"}), help_loads
    families_loads = imported_by("families", "--json")
    assert "turbospark_gemma4" in families_loads  # it did discover the plugins
    assert not families_loads & HEAVY, families_loads & HEAVY


def test_conformance_without_its_extra_names_the_extra():
    code = (
        "import sys\nsys.modules['hypothesis'] = None  # as if not installed\n"
        "from turbospark.cli import main\nsys.exit(main(['conformance', 'gemma4']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    assert "pip install 'turbospark[conformance]'" in done.stderr


def test_import_dtypes_match_the_importer():
    from turbospark.commands import import_
    from turbospark.loading.importer import DTYPES

    assert import_.DTYPES == DTYPES


def test_quantize_modes_match_the_loader():
    from turbospark.commands import QUANT_MODES
    from turbospark.loading.quantization import MODES

    assert QUANT_MODES == MODES


@pytest.mark.parametrize(
    ("text", "value"),
    [("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000), ("100", 100)],
)
def test_memory_sizes_parse(text, value):
    from turbospark.commands import byte_size

    assert byte_size(text) == value


def test_a_bad_memory_size_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["serve", "/nowhere", "--max-parked-memory", "lots"])
    assert excinfo.value.code == 2
    assert "'lots' is not a size" in capsys.readouterr().err


@pytest.fixture
def mlx_cache_limit():
    """MLX's buffer cache limit, read (MLX has no getter: setting returns the
    previous bound) through a sentinel, and put back after the test."""
    import mlx.core as mx

    sentinel = 777 << 20
    previous = mx.set_cache_limit(sentinel)
    yield lambda: mx.set_cache_limit(sentinel)
    mx.set_cache_limit(previous)


def test_serve_sets_mlx_cache_limit_before_loading(mlx_cache_limit, capsys):
    """The bound reaches MLX before the model is looked for (the path does not
    exist, so serve stops there); without the flag MLX's own bound stays."""
    assert main(["serve", "/nowhere"]) == 2
    assert mlx_cache_limit() == 777 << 20
    assert main(["serve", "/nowhere", "--mlx-cache-limit", "123MiB"]) == 2
    assert mlx_cache_limit() == 123 << 20
    assert main(["serve", "/nowhere", "--mlx-cache-limit", "0"]) == 2
    assert mlx_cache_limit() == 0
    assert "/nowhere: no such directory" in capsys.readouterr().err


def test_serve_sets_cuda_graphs_before_loading(monkeypatch, capsys):
    """``--cuda-graphs`` reaches MLX's variable before the model is looked
    for (MLX reads it once, at its first launch); without it the variable
    stays as the user left it."""
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "")  # recorded, so the test's value is undone
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")
    assert main(["serve", "/nowhere"]) == 2
    assert "MLX_USE_CUDA_GRAPHS" not in os.environ
    assert main(["serve", "/nowhere", "--cuda-graphs", "off"]) == 2
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "0"
    assert main(["serve", "/nowhere", "--cuda-graphs", "on"]) == 2
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "1"
    assert "/nowhere: no such directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as excinfo:
        main(["serve", "/nowhere", "--cuda-graphs", "maybe"])
    assert excinfo.value.code == 2
    assert "argument --cuda-graphs: invalid choice: 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "'-1': a size cannot be negative; use 0 or more"),
        ("lots", "'lots' is not a size: use bytes or a unit like 512MiB"),
        ("1e400", "'1e400' is not a size: use bytes or a unit like 512MiB"),
    ],
)
def test_serve_refuses_a_bad_mlx_cache_limit_by_name(mlx_cache_limit, capsys, value, message):
    with pytest.raises(SystemExit) as excinfo:
        main(["serve", "/nowhere", f"--mlx-cache-limit={value}"])
    assert excinfo.value.code == 2
    assert f"argument --mlx-cache-limit: {message}" in capsys.readouterr().err
    assert mlx_cache_limit() == 777 << 20  # nothing was set


def test_serve_refuses_an_mlx_cache_limit_past_what_mlx_holds(mlx_cache_limit, capsys):
    assert main(["serve", "/nowhere", "--mlx-cache-limit", "1e20"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mlx-cache-limit 100000000000000000000 bytes" in err
    assert "use a size the device has, e.g. 8GiB" in err
    assert mlx_cache_limit() == 777 << 20


@pytest.mark.parametrize("flag", ["--chunk-size", "--prefill-budget"])
def test_serve_refuses_a_token_bound_below_one_in_one_line(capsys, flag):
    """Checked before anything loads (the path does not even exist)."""
    assert main(["serve", "/nowhere", flag, "0"]) == 2
    assert f"{flag} must be positive, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_serve_refuses_a_negative_gather_in_one_line(capsys, value):
    """Checked before anything loads (the path does not even exist)."""
    assert main(["serve", "/nowhere", "--prefill-gather-ms", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--prefill-gather-ms must be 0 or more, got {value}" in err


def test_commands_keep_compiled_kernels_in_the_cache_directory(tmp_path, monkeypatch, capsys):
    """MLX's compiled GPU kernels go under turbospark's cache unless the user
    named a place: a restarted server finds them there instead of compiling
    every kernel again."""
    from importlib.metadata import version

    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path))
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    assert main(["families", "--json"]) == 0
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "kernels" / f"mlx-{version('mlx')}")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    assert main(["families", "--json"]) == 0
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "mine")
    capsys.readouterr()
