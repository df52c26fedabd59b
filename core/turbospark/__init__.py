"""turbospark: run LLM families on MLX and keep many conversations warm on one model.

The public API (a contract; see DESIGN.md) is re-exported here.
"""

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
from turbospark.hookspecs import ArchConfig, ComponentSpec, FamilySpec, hookimpl
from turbospark.install import build_synthetic_install, peek_manifest_arch
from turbospark.policies import DraftPolicies, ExpertCacheSlots, SteeringPolicy
from turbospark.reuse import ReuseReason, ReuseReport
from turbospark.runner import Runner
from turbospark.vision import MropePositions, VisionInjection

__all__ = [
    "ArchConfig",
    "ComponentSpec",
    "ContextOverflow",
    "DraftPolicies",
    "ExpertCacheSlots",
    "FamilySpec",
    "InstallError",
    "InvalidInput",
    "MropePositions",
    "PluginError",
    "ReuseReason",
    "ReuseReport",
    "RewindError",
    "Runner",
    "SessionPoolUnsupported",
    "SteeringPolicy",
    "TurbosparkError",
    "VisionInjection",
    "VisionMapError",
    "build_synthetic_install",
    "hookimpl",
    "peek_manifest_arch",
]
