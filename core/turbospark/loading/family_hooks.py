"""The hooks every family implements the same way, derived from what it declares.

A family's ``plugin.py`` writes the hooks that are its own (load the model,
build a fresh state, run a forward) and takes the other three from one
:class:`CommonHooks`::

    common = CommonHooks("gemma4", ["gemma4_text"], Gemma4Config, state_module, synthetic.build)
    turbospark_family = common.turbospark_family
    turbospark_pool_capability = common.turbospark_pool_capability
    turbospark_build_synthetic_install = common.turbospark_build_synthetic_install

They stay ordinary pluggy hookimpls of the plugin module (bound methods carry
the marker), so the entry point still names the module and a family may write
any of the three itself instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from turbospark.contract.hookspecs import ArchConfig, ComponentSpec, FamilySpec, hookimpl
from turbospark.loading.synthetic import build_checked


def source_file(module: ModuleType) -> str:
    """Where *module* lives on this machine: a checkout or a wheel's site-packages."""
    return inspect.getsourcefile(module) or str(module.__file__)


@dataclass(frozen=True)
class CommonHooks:
    """``turbospark_family``, ``turbospark_pool_capability`` and
    ``turbospark_build_synthetic_install`` from a family's declarations.

    *state* is the module defining ``COMPONENTS`` (its file becomes
    ``state_source``, named in refusals); *build* is the synthetic-install
    builder, whose keyword arguments are the dims a caller may pass.
    """

    name: str
    model_types: list[str]
    arch_config: type[ArchConfig]
    state: ModuleType
    build: Callable[..., ArchConfig]
    # Whether its forwards call ``steer`` at each layer's output (turbospark.policies.steering).
    steerable: bool = False
    # Whether its attention reads K/V through core's cached_attention (a quantized cache works).
    kv_quantizable: bool = False

    @property
    def components(self) -> list[ComponentSpec]:
        return list(self.state.COMPONENTS)

    @hookimpl
    def turbospark_family(self) -> FamilySpec:
        return FamilySpec(
            name=self.name,
            model_types=self.model_types,
            arch_config=self.arch_config,
            components=self.components,
            state_source=source_file(self.state),
            steerable=self.steerable,
            kv_quantizable=self.kv_quantizable,
        )

    @hookimpl
    def turbospark_pool_capability(self, arch: ArchConfig) -> list[str]:
        """Every swappable component, whatever the arch: families whose pool
        support depends on the arch write this hook themselves."""
        return [spec.name for spec in self.components if spec.swappable]

    @hookimpl
    def turbospark_build_synthetic_install(self, path: Path, dims: dict[str, Any]) -> ArchConfig:
        return build_checked(self.name, self.build, path, dims)  # unknown dims refused by name
