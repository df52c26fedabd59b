"""Module paths from before the layout had parts, served from their new places for one
SDK minor version, each with a DeprecationWarning that names the new path.

Families import :mod:`turbospark.sdk`; these aliases only keep a family written
against the old flat modules importing while its author moves it over.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

REMOVED_IN = "1.2"  # the SDK minor version that drops these aliases

MOVED = {
    "turbospark.hookspecs": "turbospark.contract.hookspecs",
    "turbospark.vision": "turbospark.contract.vision",
    "turbospark.batch": "turbospark.state.kv",
    "turbospark.sharding": "turbospark.layers.sharding",
    "turbospark.layers.attention_cuda": "turbospark.layers.cuda.attention",
    "turbospark.layers.gdn_cuda": "turbospark.layers.cuda.gdn",
    "turbospark.layers.heads_cuda": "turbospark.layers.cuda.heads",
    "turbospark.layers.norm_cuda": "turbospark.layers.cuda.norm",
    "turbospark.layers.reduce_cuda": "turbospark.layers.cuda.reduce",
    "turbospark.layers.steer_cuda": "turbospark.layers.cuda.steer",
    "turbospark.plugins": "turbospark.loading.plugins",
    "turbospark.defaults": "turbospark.loading.defaults",
    "turbospark.family": "turbospark.loading.family_hooks",
    "turbospark.install": "turbospark.loading.install",
    "turbospark.importer": "turbospark.loading.importer",
    "turbospark.hf_config": "turbospark.loading.checkpoint_config",
    "turbospark.synthetic": "turbospark.loading.synthetic",
    "turbospark.text.hf_config": "turbospark.text.tokenizer_files",
    "turbospark.steering": "turbospark.policies.steering",
    "turbospark.control_vectors": "turbospark.policies.control_vectors",
    "turbospark.expert_cache": "turbospark.policies.expert_cache",
    "turbospark.pool": "turbospark.sessions.pool",
    "turbospark.reuse": "turbospark.sessions.reuse",
    "turbospark.prefix": "turbospark.sessions.prefix",
    "turbospark.disk": "turbospark.sessions.session_file",
    "turbospark.disk_store": "turbospark.sessions.disk_tier",
    "turbospark.runner": "turbospark.generation.runner",
    "turbospark.engine": "turbospark.generation.engine",
    "turbospark.generate": "turbospark.generation.generate",
    "turbospark.sampling": "turbospark.generation.sampling",
    "turbospark.logits_processors": "turbospark.generation.logits_processors",
    "turbospark.draft": "turbospark.generation.drafters",
    "turbospark.mtp": "turbospark.generation.mtp",
    "turbospark.speculative": "turbospark.generation.speculation",
    "turbospark.distributed": "turbospark.generation.distributed",
}


def warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new} and the old path goes in SDK {REMOVED_IN}; "
        "a family imports everything from turbospark.sdk",
        DeprecationWarning,
        stacklevel=3,
    )


class _Alias(importlib.abc.Loader):
    """Loads an old path as the new module itself (``old is new``), warning once per import."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warn(spec.name, new)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported."""


class MovedFinder(importlib.abc.MetaPathFinder):
    """Consulted after the real finders, so it sees only paths that no longer exist."""

    def find_spec(
        self, fullname: str, path: object, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias())


def install() -> None:
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
