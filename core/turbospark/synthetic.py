"""What every family's synthetic install shares: seeded random tensors under
checkpoint names, the check of the size knobs, and the write through the same
:func:`~turbospark.install.write_install` a real import uses (with the small
tokenizer and chat template from :mod:`turbospark.text`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from turbospark.errors import InvalidInput
from turbospark.hookspecs import ArchConfig
from turbospark.install import write_install
from turbospark.text import synthetic_text_files

DTYPES = ("float32", "float16", "bfloat16")


class RandomWeights:
    """Named random tensors from one seeded generator. Nothing is neutral (norm
    weights are not all ones), so a skipped norm or a mis-wired gate shows."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def linear(self, name: str, shape: tuple[int, ...]) -> None:
        """``(..., out, in)`` with unit-variance outputs for unit-variance inputs."""
        self.tensors[name] = self.rng.normal(0.0, shape[-1] ** -0.5, shape)

    def scale(self, name: str, shape: tuple[int, ...], spread: float = 0.2) -> None:
        """A positive scale around 1 (norm weights used as is, layer scalars)."""
        self.tensors[name] = 1.0 + self.rng.uniform(-spread, spread, shape)

    def centred(self, name: str, shape: tuple[int, ...], spread: float = 0.2) -> None:
        """A zero-centred norm weight (the model multiplies by ``1 + w``)."""
        self.tensors[name] = self.rng.uniform(-spread, spread, shape)


def write_synthetic(
    path: Path,
    arch: ArchConfig,
    model_id: str,
    tensors: dict[str, np.ndarray | mx.array],
    dtype: str,
) -> ArchConfig:
    """Cast *tensors* to *dtype* and write the install with tokenizer files."""
    if dtype not in DTYPES:
        raise InvalidInput(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    target = getattr(mx, dtype)
    weights = {
        name: mx.array(np.asarray(value, dtype=np.float32)).astype(target)
        for name, value in tensors.items()
    }
    write_install(
        path, arch=arch, model_id=model_id, weights=weights, extra_files=synthetic_text_files(arch)
    )
    return arch


def build_checked(
    family: str, build: Callable[..., ArchConfig], path: Path, dims: dict[str, Any]
) -> ArchConfig:
    """Call ``build(path, **dims)`` after refusing dims it does not take, by name."""
    known = set(inspect.signature(build).parameters) - {"path"}
    unknown = sorted(set(dims) - known)
    if unknown:
        raise InvalidInput(
            f"{family} synthetic installs have no dim(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    return build(path, **dims)
