"""Plugin discovery and validation: a broken family plugin is named, never fatal.

Throwaway plugins are registered into a registry beside the real gemma4 and
unregistered by the fixture; entry-point failures use a throwaway
distribution (a ``.dist-info`` directory on ``sys.path``) so discovery sees
them exactly as it sees an installed package.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from turbospark import Runner, build_synthetic_install, hookimpl
from turbospark.cli import main
from turbospark.contract.hookspecs import FamilySpec
from turbospark.errors import FamilyNotFound, PluginError
from turbospark.loading.checkpoint_config import HFConfig
from turbospark.loading.importer import resolve_arch
from turbospark.loading.plugins import FamilyRegistry, default_registry


class WrongSignature:
    """Declares ``turbospark_forward`` with an argument the contract does not have."""

    @hookimpl
    def turbospark_forward(self, model: object, tokens: mx.array, position_ids: mx.array) -> None:
        return None


class MisspelledHook:
    """A ``turbospark_*`` hook with a typo: it would silently never be called."""

    @hookimpl
    def turbospark_familly(self) -> FamilySpec:
        return default_registry().get("gemma4").spec


class SecondGemma4:
    """Claims a family name another plugin already provides."""

    @hookimpl
    def turbospark_family(self) -> FamilySpec:
        return default_registry().get("gemma4").spec


@pytest.fixture
def registry() -> Iterator[FamilyRegistry]:
    """gemma4 plus whatever a test registers; throwaways are unregistered after."""
    registry = FamilyRegistry()
    registry.register(default_registry().get("gemma4").plugin, name="gemma4")
    yield registry
    for name in [n for n in registry.families if n != "gemma4"]:
        registry.unregister(name)


def opens(registry: FamilyRegistry, path: Path) -> bool:
    build_synthetic_install("gemma4", path, registry=registry, num_layers=2)
    return Runner.open(path, registry=registry).prefill_chunk([1, 2, 3], 0).shape == (128,)


@pytest.mark.parametrize(
    "plugin, name, says",
    [
        (WrongSignature(), "wrong_signature", "position_ids"),
        (MisspelledHook(), "misspelled", "turbospark_familly"),
        (SecondGemma4(), "second_gemma4", "family 'gemma4' is already provided by <registered>"),
    ],
)
def test_a_bad_plugin_is_refused_by_name_and_others_keep_working(
    registry: FamilyRegistry, tmp_path: Path, plugin: object, name: str, says: str
) -> None:
    with pytest.raises(PluginError) as refused:
        registry.register(plugin, name=name)
    assert says in str(refused.value)
    (broken,) = registry.broken
    assert broken.name == name and says in broken.error
    assert list(registry.families) == ["gemma4"]
    described = registry.describe_installed()
    assert described.startswith("installed: gemma4 (gemma4_text); broken: ")
    assert f"{name}: " in described
    assert opens(registry, tmp_path)


def fake_distribution(root: Path, entry_points: dict[str, str]) -> None:
    """An installed distribution as importlib.metadata sees one: a dist-info directory."""
    info = root / "turbospark_throwaway-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: turbospark-throwaway\nVersion: 0.1.0\n"
    )
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[turbospark]\n{lines}")


@pytest.fixture
def throwaway_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Entry points: one whose module fails to import, one with a bad hook;
    returns an allowlist naming them and gemma4."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "turbospark_throwaway_badsig.py").write_text(
        "from turbospark import hookimpl\n\n\n"
        "@hookimpl\n"
        "def turbospark_new_state(arch, model, context, extra):\n"
        "    return {}\n"
    )
    fake_distribution(
        site,
        {
            "throwaway_import": "turbospark_throwaway_missing_module",
            "throwaway_badsig": "turbospark_throwaway_badsig",
        },
    )
    monkeypatch.syspath_prepend(str(site))
    # A fresh allowlist string: default_registry() caches per allowlist.
    return f"gemma4,throwaway_import,throwaway_badsig,{tmp_path.name}"


def test_discovery_names_broken_entry_points_and_loads_the_rest(
    throwaway_dist: str, tmp_path: Path
) -> None:
    registry = FamilyRegistry.discover(throwaway_dist)
    assert list(registry.families) == ["gemma4"]
    errors = {b.name: (b.source, b.error) for b in registry.broken}
    assert errors.keys() == {"throwaway_import", "throwaway_badsig"}
    source, error = errors["throwaway_import"]
    assert source == "turbospark-throwaway==0.1.0"
    assert error.startswith(
        "import of turbospark_throwaway_missing_module failed: ModuleNotFoundError"
    )
    assert (
        "plugin 'throwaway_badsig' does not fit the family contract"
        in errors["throwaway_badsig"][1]
    )
    assert "extra" in errors["throwaway_badsig"][1]
    with pytest.raises(FamilyNotFound) as missing:
        registry.get("throwaway_import")
    assert "broken: throwaway_badsig: " in str(missing.value)
    assert opens(registry, tmp_path / "install")


def test_families_command_lists_broken_plugins(
    throwaway_dist: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TURBOSPARK_PLUGINS", throwaway_dist)
    assert main(["families", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [f["name"] for f in listing["families"]] == ["gemma4"]
    assert sorted(b["name"] for b in listing["broken"]) == ["throwaway_badsig", "throwaway_import"]
    assert main(["families"]) == 0
    text = capsys.readouterr().out
    assert "BROKEN throwaway_import (turbospark-throwaway==0.1.0): import of" in text


class OtherGemma4Loader:
    """A differently named family that also claims gemma4's ``model_type``."""

    @hookimpl
    def turbospark_family(self) -> FamilySpec:
        return default_registry().get("gemma4").spec.model_copy(update={"name": "gemma4_fork"})


def test_a_model_type_claimed_twice_is_refused_naming_both(
    registry: FamilyRegistry, tmp_path: Path
) -> None:
    """Importing by ``model_type`` never picks one of two claimants silently;
    ``--family`` still chooses, and each family still opens its own installs."""
    registry.register(OtherGemma4Loader(), name="gemma4_fork")
    with pytest.raises(PluginError) as refused:
        registry.for_model_type("gemma4_text")
    assert str(refused.value) == (
        "Hugging Face model_type 'gemma4_text' is claimed by families 'gemma4' (<registered>) "
        "and 'gemma4_fork' (<registered>); pass --family NAME to choose one, or uninstall the other"
    )
    build_synthetic_install("gemma4", tmp_path, registry=registry, num_layers=2)
    config = HFConfig.model_validate_json((tmp_path / "config.json").read_text())
    assert resolve_arch(config, "gemma4", registry).family == "gemma4"
    assert opens(registry, tmp_path / "again")
