"""A third-party family installed the way its users install it: as a wheel.

Once per session, the turbospark core and ``examples/third_party_family`` are
built into wheels and installed, with a deliberately broken plugin
distribution (its entry point's import fails), into a fresh virtual
environment. There, outside this repository and its conftest, the example is
listed by ``turbospark families``, the broken plugin is named without
stopping it, the conformance kit passes from the command line, and the
example's own tests (mlx-lm parity and the kit through turbospark's
``pytest11`` fixtures) pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "third_party_family"
BROKEN_ERROR = "turbospark_missing_dependency_xyz"
BROKEN_PYPROJECT = """\
[project]
name = "turbospark-broken-example"
version = "0.1.0"

[project.entry-points.turbospark]
broken_example = "turbospark_broken_example"

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"
"""


pytestmark = pytest.mark.slow  # builds three wheels and a venv


@dataclass(frozen=True)
class Venv:
    root: Path
    env: dict[str, str]

    def run(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.root / "bin" / args[0]), *args[1:]],
            cwd=cwd or self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )


# `uv run` names its own binary in $UV, so this works even where uv is not on PATH.
UV = os.environ.get("UV") or shutil.which("uv")


def uv(*args: str, cwd: Path = ROOT) -> None:
    done = subprocess.run([UV, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"uv {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


def broken_distribution(path: Path) -> Path:
    """A plugin distribution whose entry point's module fails to import."""
    (path / "turbospark_broken_example").mkdir(parents=True)
    (path / "pyproject.toml").write_text(BROKEN_PYPROJECT)
    (path / "turbospark_broken_example" / "__init__.py").write_text(
        f"import {BROKEN_ERROR}  # a dependency the author forgot to declare\n"
    )
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    if UV is None:
        pytest.skip("uv is neither on PATH nor named by $UV (`uv run` sets it)")
    tmp = tmp_path_factory.mktemp("plugin-install")
    dist = tmp / "dist"
    uv("build", "--wheel", "--quiet", "core", "-o", str(dist))
    uv("build", "--wheel", "--quiet", str(EXAMPLE), "-o", str(dist))
    uv("build", "--wheel", "--quiet", str(broken_distribution(tmp / "broken")), "-o", str(dist))
    root = tmp / "venv"
    uv("venv", "--quiet", str(root), "--python", sys.executable)
    wheels = sorted(str(w) for w in dist.glob("*.whl"))
    assert len(wheels) == 3, wheels
    # As a family author does: the example with its test extra, which asks for
    # turbospark[conformance] (pytest, hypothesis), satisfied by the core wheel here.
    (example,) = [w for w in wheels if "tinyllama" in Path(w).name]
    uv("pip", "install", "--quiet", "--python", str(root / "bin" / "python"),
       *wheels, f"turbospark-tinyllama[test] @ {Path(example).as_uri()}",
       f"mlx-lm=={version('mlx-lm')}")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("TURBOSPARK_PLUGINS", "VIRTUAL_ENV")}
    return Venv(root, env)


def test_families_lists_the_example_and_names_the_broken_plugin(venv: Venv) -> None:
    done = venv.run("turbospark", "families", "--json")
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    (family,) = [f for f in listing["families"] if f["name"] == "tinyllama"]
    assert family["source"] == "turbospark-tinyllama==0.1.0"
    assert family["model_types"] == ["llama"]
    assert [c["name"] for c in family["components"]] == ["kv"]
    (broken,) = listing["broken"]
    assert broken["name"] == "broken_example"
    assert broken["source"] == "turbospark-broken-example==0.1.0"
    assert "import of turbospark_broken_example failed" in broken["error"]
    assert BROKEN_ERROR in broken["error"]

    text = venv.run("turbospark", "families")
    assert "tinyllama  (llama)  from turbospark-tinyllama==0.1.0" in text.stdout
    assert "BROKEN broken_example (turbospark-broken-example==0.1.0)" in text.stdout


def test_conformance_command_passes_in_the_fresh_venv(venv: Venv) -> None:
    done = venv.run("turbospark", "conformance", "tinyllama", "--json", "--examples", "5")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] and report["source"] == "turbospark-tinyllama==0.1.0"
    outcomes = {c["check"]: (c["outcome"], c["detail"]) for c in report["checks"]}
    assert outcomes["pool_refused_by_name"] == ("skipped", "every component is swappable")
    assert outcomes["parked_sessions_resume_exactly"] == ("passed", "")
    assert outcomes["interleaved_conversations_never_cross_talk"] == ("passed", "")
    assert outcomes["rewind_then_refeed[kv]"] == ("passed", "")
    assert report["counts"]["failed"] == report["counts"]["error"] == 0


def test_the_example_own_tests_pass_in_the_fresh_venv(venv: Venv, tmp_path: Path) -> None:
    """The author's workflow: parity with mlx-lm and the kit as a one-class test
    module whose fixtures come from turbospark's pytest11 plugin (no conftest)."""
    checkout = tmp_path / "third_party_family"
    shutil.copytree(EXAMPLE, checkout)
    done = venv.run("python", "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests", cwd=checkout)
    assert done.returncode == 0, done.stdout + done.stderr
    for ran in (
        "test_tinyllama_parity.py::test_matches_mlx_lm[gqa] PASSED",
        "test_tinyllama_parity.py::test_matches_mlx_lm[mha_tied] PASSED",
        "test_tinyllama_parity.py::test_mlx_lm_tokenizes_a_chat_exactly_as_we_do PASSED",
        "test_tinyllama_parity.py::test_long_uneven_chunked_prefill_matches_mlx_lm PASSED",
        "TestTinyLlama::test_long_prompt_chunked_equals_one_chunk PASSED",
        "TestTinyLlama::test_snapshot_round_trip[kv] PASSED",
        "TestTinyLlama::test_interleaved_conversations_never_cross_talk PASSED",
    ):
        assert ran in done.stdout, done.stdout
