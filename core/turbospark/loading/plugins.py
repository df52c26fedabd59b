"""Family discovery: entry points, validation, and one plugin manager per family.

Built-in families are ordinary distributions registering under the entry-point
group ``turbospark``, exactly like a third party's; the core never imports a
family by name. Each plugin is loaded and validated on its own, so one that
fails to import or declares a hook wrongly is reported by name and the others
keep working. ``TURBOSPARK_PLUGINS`` is an allowlist (comma-separated entry
point names; ``none`` disables every plugin) so tests never pick up strays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import Any

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from turbospark.contract import API_VERSION, hookspecs
from turbospark.contract.hookspecs import FamilySpec
from turbospark.errors import FamilyNotFound, PluginError
from turbospark.loading import defaults

GROUP = "turbospark"
ALLOWLIST_ENV = "TURBOSPARK_PLUGINS"


def new_manager() -> pluggy.PluginManager:
    """An empty plugin manager that knows the family contract."""
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    return pm


@dataclass(frozen=True)
class Family:
    """A validated family plugin and its declaration."""

    name: str
    plugin: Any
    spec: FamilySpec
    source: str  # "dist==version" or "<registered>"

    def manager(self) -> pluggy.PluginManager:
        """A fresh manager holding only this family (a runner adds its own extensions)."""
        pm = new_manager()
        pm.register(defaults, name="turbospark.loading.defaults")
        pm.register(self.plugin, name=self.name)
        return pm


@dataclass(frozen=True)
class BrokenPlugin:
    name: str
    source: str
    error: str


@dataclass
class FamilyRegistry:
    families: dict[str, Family] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)

    @classmethod
    def discover(cls, allow: str | None = None) -> FamilyRegistry:
        """Load every entry point of the ``turbospark`` group (filtered by *allow*)."""
        registry = cls()
        allowed = _parse_allowlist(allow)
        for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
            if allowed is not None and ep.name not in allowed:
                continue
            source = f"{ep.dist.name}=={ep.dist.version}" if ep.dist else ep.value
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must not stop the others
                registry.broken.append(
                    BrokenPlugin(
                        ep.name, source, f"import of {ep.value} failed: {type(exc).__name__}: {exc}"
                    )
                )
                continue
            registry._add(plugin, ep.name, source)
        return registry

    def register(self, plugin: Any, name: str | None = None) -> Family:
        """Add an in-process plugin (tests, notebooks); raises :class:`PluginError` if invalid."""
        family = self._add(
            plugin, name or getattr(plugin, "__name__", repr(plugin)), "<registered>"
        )
        if family is None:
            raise PluginError(self.broken[-1].error)
        return family

    def unregister(self, name: str) -> None:
        self.families.pop(name, None)

    def _add(self, plugin: Any, ep_name: str, source: str) -> Family | None:
        try:
            spec = _validate(plugin, ep_name)
        except Exception as exc:
            self.broken.append(BrokenPlugin(ep_name, source, str(exc)))
            return None
        if spec.name in self.families:
            other = self.families[spec.name].source
            self.broken.append(
                BrokenPlugin(
                    ep_name,
                    source,
                    f"family '{spec.name}' is already provided by {other}; uninstall one",
                )
            )
            return None
        family = Family(spec.name, plugin, spec, source)
        self.families[spec.name] = family
        return family

    def get(self, name: str) -> Family:
        if name in self.families:
            return self.families[name]
        raise FamilyNotFound(
            f"no installed plugin provides family '{name}'; {self.describe_installed()}"
        )

    def for_model_type(self, model_type: str) -> Family:
        """The one family that loads *model_type*. Two claiming it is refused,
        naming both with their distributions: picking the first found would
        depend on entry-point order, silently."""
        claims = [f for f in self.families.values() if model_type in f.spec.model_types]
        if len(claims) > 1:
            named = " and ".join(f"'{f.name}' ({f.source})" for f in claims)
            raise PluginError(
                f"Hugging Face model_type '{model_type}' is claimed by families {named}; "
                "pass --family NAME to choose one, or uninstall the other"
            )
        if claims:
            return claims[0]
        raise FamilyNotFound(
            f"no installed family loads Hugging Face model_type '{model_type}'; "
            f"{self.describe_installed()}; pass --family NAME to load it with one of them"
        )

    def describe_installed(self) -> str:
        if not self.families:
            hint = (
                f" ({ALLOWLIST_ENV}={os.environ[ALLOWLIST_ENV]!r})"
                if ALLOWLIST_ENV in os.environ
                else ""
            )
            text = f"no family plugins are installed{hint}"
        else:
            listed = ", ".join(
                f"{f.name} ({', '.join(f.spec.model_types)})" for f in self.families.values()
            )
            text = f"installed: {listed}"
        if self.broken:
            text += "; broken: " + "; ".join(f"{b.name}: {b.error}" for b in self.broken)
        return text + ". Install the family's distribution (pip install turbospark-<family>)"


def _parse_allowlist(allow: str | None) -> set[str] | None:
    value = os.environ.get(ALLOWLIST_ENV) if allow is None else allow
    if value is None:
        return None
    value = value.strip()
    if value.lower() == "none":
        return set()
    return {part.strip() for part in value.split(",") if part.strip()} or None


def _validate(plugin: Any, name: str) -> FamilySpec:
    """Check the SDK range the plugin declares, then register it into a scratch
    manager: pluggy checks hook signatures, and ``check_pending`` catches a
    misspelled ``turbospark_*`` function."""
    _check_sdk(plugin, name)
    pm = new_manager()
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin '{name}' does not fit the family contract: {exc}") from exc
    spec = pm.hook.turbospark_family()
    if not isinstance(spec, FamilySpec):
        raise PluginError(
            f"plugin '{name}': turbospark_family() returned {type(spec).__name__}, not FamilySpec"
        )
    return spec


def _check_sdk(plugin: Any, name: str) -> None:
    """A plugin's ``TURBOSPARK_SDK`` (a PEP 440 specifier, e.g. ``">=1.0,<2"``)
    must admit this SDK's :data:`~turbospark.contract.API_VERSION`; a plugin
    without one is taken as written for this version."""
    wanted = getattr(plugin, "TURBOSPARK_SDK", None)
    if wanted is None:
        return
    try:
        admitted = SpecifierSet(str(wanted))
    except InvalidSpecifier:
        raise PluginError(
            f"plugin '{name}': TURBOSPARK_SDK = {wanted!r} is not a version specifier; "
            "write a range such as '>=1.0,<2'"
        ) from None
    if API_VERSION not in admitted:
        raise PluginError(
            f"plugin '{name}' is written for turbospark SDK {wanted}, and this turbospark has "
            f"SDK {API_VERSION}; install a release of the plugin for SDK {API_VERSION}, or a "
            "turbospark whose SDK its range admits"
        )


@cache
def _discover_cached(allow: str | None) -> FamilyRegistry:
    return FamilyRegistry.discover(allow)


def default_registry() -> FamilyRegistry:
    """The process-wide registry for the current allowlist (discovered on first use)."""
    return _discover_cached(os.environ.get(ALLOWLIST_ENV))


def family_hooks(name: str) -> pluggy.HookRelay:
    """Family *name*'s hooks as a runner calls them (its own plugin, then core's
    defaults): what a family's tests call to drive the family directly."""
    return default_registry().get(name).manager().hook
