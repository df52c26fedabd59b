"""turbospark: run LLM families on MLX and keep many conversations warm on one model.

The public API (a contract, called exactly as README's "Python API" shows it;
``tests/test_public_api.py`` holds it to that) is re-exported here. Names
load on first use (PEP 562), so importing a light submodule -- the CLI's
parser, the errors -- does not pull in MLX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from turbospark.contract.hookspecs import ArchConfig, ComponentSpec, FamilySpec, hookimpl
    from turbospark.contract.vision import MropePositions, VisionInjection
    from turbospark.errors import (
        ContextOverflow,
        InstallError,
        InvalidInput,
        PluginError,
        RewindError,
        SessionPoolUnsupported,
        TurbosparkError,
        VisionMapError,
    )
    from turbospark.generation.engine import Engine, Job
    from turbospark.generation.generate import (
        Completion,
        GenerationConfig,
        generate,
        stream_generate,
    )
    from turbospark.generation.runner import Runner
    from turbospark.loading.install import build_synthetic_install, peek_manifest_arch
    from turbospark.policies import DraftPolicies, ExpertCacheSlots, SteeringPolicy
    from turbospark.sessions.reuse import ReuseReason, ReuseReport
    from turbospark.text import TextCodec, load_text

__all__ = [
    "ArchConfig",
    "Completion",
    "ComponentSpec",
    "ContextOverflow",
    "DraftPolicies",
    "Engine",
    "ExpertCacheSlots",
    "FamilySpec",
    "GenerationConfig",
    "InstallError",
    "InvalidInput",
    "Job",
    "MropePositions",
    "PluginError",
    "ReuseReason",
    "ReuseReport",
    "RewindError",
    "Runner",
    "SessionPoolUnsupported",
    "SteeringPolicy",
    "TextCodec",
    "TurbosparkError",
    "VisionInjection",
    "VisionMapError",
    "build_synthetic_install",
    "generate",
    "hookimpl",
    "load_text",
    "peek_manifest_arch",
    "stream_generate",
]

# The module defining each public name, imported when the name is first used.
_MODULES = {
    "turbospark.errors": [
        "ContextOverflow",
        "InstallError",
        "InvalidInput",
        "PluginError",
        "RewindError",
        "SessionPoolUnsupported",
        "TurbosparkError",
        "VisionMapError",
    ],
    "turbospark.contract.hookspecs": ["ArchConfig", "ComponentSpec", "FamilySpec", "hookimpl"],
    "turbospark.loading.install": ["build_synthetic_install", "peek_manifest_arch"],
    "turbospark.policies": ["DraftPolicies", "ExpertCacheSlots", "SteeringPolicy"],
    "turbospark.sessions.reuse": ["ReuseReason", "ReuseReport"],
    "turbospark.generation.engine": ["Engine", "Job"],
    "turbospark.generation.generate": [
        "Completion",
        "GenerationConfig",
        "generate",
        "stream_generate",
    ],
    "turbospark.generation.runner": ["Runner"],
    "turbospark.text": ["TextCodec", "load_text"],
    "turbospark.contract.vision": ["MropePositions", "VisionInjection"],
}
_SOURCES = {name: module for module, names in _MODULES.items() for name in names}
assert sorted(_SOURCES) == sorted(__all__), "every public name needs its module, and no more"


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module 'turbospark' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
