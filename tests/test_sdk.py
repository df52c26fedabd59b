"""The family SDK: its version, what it exports, the range a plugin declares, and deprecations."""

from __future__ import annotations

import importlib
import types

import pytest
from packaging.version import Version

import turbospark.sdk as sdk
from turbospark.errors import PluginError
from turbospark.loading.plugins import FamilyRegistry, default_registry


def test_api_version_is_semantic() -> None:
    version = Version(sdk.API_VERSION)
    assert len(version.release) == 3 and not version.is_prerelease


def test_every_exported_name_resolves() -> None:
    missing = [name for name in sdk.__all__ if not hasattr(sdk, name)]
    assert not missing and len(set(sdk.__all__)) == len(sdk.__all__)


def _gemma4_as(name: str, wanted: object) -> types.ModuleType:
    """The gemma4 plugin's hooks in a module of its own that declares *wanted*."""
    plugin = types.ModuleType(name)
    source = default_registry().get("gemma4").plugin
    for attr in dir(source):
        if attr.startswith("turbospark_"):
            setattr(plugin, attr, getattr(source, attr))
    plugin.TURBOSPARK_SDK = wanted
    return plugin


def test_a_plugin_whose_range_admits_this_sdk_registers() -> None:
    registry = FamilyRegistry()
    family = registry.register(_gemma4_as("gemma4_now", ">=1.0,<2"))
    assert family.name == "gemma4"


@pytest.mark.parametrize(
    ("wanted", "says"),
    [(">=2.0", "is written for turbospark SDK >=2.0"), ("one point oh", "not a version specifier")],
)
def test_a_plugin_for_another_sdk_is_refused_by_name(wanted: str, says: str) -> None:
    registry = FamilyRegistry()
    with pytest.raises(PluginError, match="plugin 'gemma4_later'") as refused:
        registry.register(_gemma4_as("gemma4_later", wanted))
    assert says in str(refused.value) and "gemma4" not in registry.families
    assert registry.broken[-1].name == "gemma4_later"


def test_a_deprecated_name_still_works_and_names_its_replacement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sdk.DEPRECATED, "OldKV", ("turbospark.sdk.KVComponent", "1.1"))
    with pytest.warns(
        DeprecationWarning, match=r"OldKV .* SDK 1\.1; use turbospark\.sdk\.KVComponent"
    ):
        assert sdk.OldKV is sdk.KVComponent  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        _ = sdk.Nothing  # type: ignore[attr-defined]


def test_a_component_spec_takes_its_capabilities_from_the_class() -> None:
    spec = sdk.ComponentSpec.of(sdk.GDNComponent.CAPABILITIES, "gdn", "recurrent state")
    assert (spec.swappable, spec.rewindable, spec.batchable, spec.traceable) == (
        True, False, True, True,
    )  # fmt: skip
    ring = sdk.ComponentSpec.of(sdk.KVComponent.WINDOWED, "window", "a ring")
    assert ring.rewindable == "window" and ring.batchable
    narrowed = sdk.ComponentSpec.of(sdk.KVComponent.CAPABILITIES, "kv", "k/v", swappable=False)
    assert not narrowed.swappable and narrowed.rewindable is True


def test_a_component_spec_never_widens_its_class() -> None:
    with pytest.raises(ValueError, match=r"component 'gdn': rewindable=True widens"):
        sdk.ComponentSpec.of(sdk.GDNComponent.CAPABILITIES, "gdn", "recurrent", rewindable=True)
    with pytest.raises(ValueError, match=r"rewindable=True widens .* rewindable='window'"):
        sdk.ComponentSpec.of(sdk.KVComponent.WINDOWED, "window", "a ring", rewindable=True)


@pytest.mark.parametrize("name", ["attention_cuda", "claim_rows", "gdn_cuda", "mixer_input_bias"])
def test_the_names_deprecated_in_1_1_are_gone(name: str) -> None:
    assert not sdk.DEPRECATED
    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(sdk, name)


def test_the_flat_module_paths_are_gone() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("turbospark.runner")
