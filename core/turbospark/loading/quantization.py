"""Quantized checkpoints as mlx-lm writes them: read, recognised per module, described.

A checkpoint quantized by ``mlx_lm.convert -q`` (or ``turbospark import
--quantize``) stores each quantized module's packed ``weight`` beside its
``scales`` (and, in affine mode, ``biases``), and records the settings in
``config.json``'s ``quantization`` block: the defaults plus per-module
overrides (``{"group_size": 64, "bits": 8}``) or ``false`` for modules kept in
floating point. The tensors are the ground truth: mlx-lm itself infers each
module's settings from the shapes of its packed weight and scales, and so do
we (:func:`infer_spec`), so a checkpoint loads exactly as mlx-lm loads it, and
a module whose shapes fit no setting is refused by name.

A module opts in by having ``to_quantized`` (``nn.Linear``, ``nn.Embedding``)
or, for stacked expert tables that are no single module, ``quantize_from``
(see :class:`turbospark.layers.experts.ExpertLayer`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import BaseModel, ConfigDict, ValidationError

from turbospark.errors import InstallError
from turbospark.layers.packing import AFFINE_BITS, FIXED, MODES, Mode, QuantSpec, spec_of
from turbospark.loading.checkpoint_config import describe

__all__ = ["AFFINE_BITS", "FIXED", "MODES", "Mode", "QuantSpec", "Quantization", "infer_spec"]


class Quantization(BaseModel):
    """``config.json``'s ``quantization`` block: defaults and per-module overrides."""

    model_config = ConfigDict(frozen=True)

    default: QuantSpec
    overrides: dict[str, QuantSpec | Literal[False]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Quantization | None:
        """The block mlx-lm writes (``quantization``; ``quantization_config`` is
        its copy for transformers), or None for a floating-point checkpoint."""
        block = config.get("quantization") or config.get("quantization_config")
        text = config.get("text_config") or {}
        block = block or text.get("quantization") or text.get("quantization_config")
        if not block:
            return None
        if not isinstance(block, dict):
            raise InstallError("config.json's quantization is not an object; re-run the convert")
        defaults = {k: block[k] for k in ("group_size", "bits", "mode") if k in block}
        overrides = {k: v for k, v in block.items() if isinstance(v, dict | bool)}
        try:
            return cls(default=QuantSpec(**defaults), overrides=overrides)
        except (ValidationError, TypeError) as exc:
            detail = describe(exc) if isinstance(exc, ValidationError) else str(exc)
            raise InstallError(
                f"config.json's quantization block is malformed ({detail}); "
                "it should hold group_size, bits and mode as mlx-lm writes them"
            ) from exc

    def to_config(self) -> dict[str, Any]:
        """The block as mlx-lm writes it (defaults, then overrides by path)."""
        block: dict[str, Any] = self.default.model_dump()
        for path, spec in sorted(self.overrides.items()):
            block[path] = spec if spec is False else spec.model_dump()
        return block


def infer_spec(path: str, in_dims: int, weights: dict[str, mx.array]) -> QuantSpec:
    """The settings *path*'s packed weight was written with, from its shapes."""
    packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
    return spec_of(path, in_dims, packed, scales, f"{path}.biases" in weights)


def quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, QuantSpec]:
    """Turn every module of *model* that *weights* store quantized into its
    quantized form, with the settings its tensors were packed with, before the
    weights are loaded; returns the settings by module path."""
    specs: dict[str, QuantSpec] = {}
    for path, module in model.named_modules():
        if hasattr(module, "quantize_from"):
            specs.update(module.quantize_from(path, weights))
        elif f"{path}.scales" in weights and f"{path}.weight" in weights:
            if not hasattr(module, "to_quantized"):
                raise InstallError(
                    f"{path} is stored quantized but {type(module).__name__} has no quantized "
                    f"form; convert the checkpoint leaving it in floating point"
                )
            specs[path] = infer_spec(path, module.weight.shape[-1], weights)
    if specs:
        nn.quantize(
            model,
            class_predicate=lambda p, m: (
                specs[p].model_dump() if p in specs and hasattr(m, "to_quantized") else False
            ),
        )
    return specs


def quantization_of(model: nn.Module) -> dict[str, QuantSpec]:
    """The settings of every quantized module of a loaded *model*, by path."""
    found: dict[str, QuantSpec] = {}
    for path, module in model.named_modules():
        held = getattr(module, "quantized_specs", None)
        if callable(held):
            found.update(held(path))
        elif isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            found[path] = QuantSpec(
                group_size=module.group_size, bits=module.bits, mode=module.mode
            )
    return found


def summary(specs: dict[str, QuantSpec]) -> str | None:
    """One phrase for a loaded model's quantization (:func:`describe_counts`);
    None when nothing is quantized."""
    return describe_counts(Counter(specs.values())) if specs else None


def describe_counts(counts: Counter[QuantSpec], floating: int = 0) -> str:
    """One phrase for how many modules use each setting, *floating* more kept in
    floating point: ``4-bit affine, group 64`` when all share one; a mixed
    checkpoint (``mlx_lm.convert --quant-predicate mixed_2_6``, or experts'
    routers at 8 bits) names that it is mixed, its widths, and every setting
    with its count, most common first, so no width is claimed that no module
    has (the config's default may be one)."""
    kept = [f"{floating} in floating point"] if floating else []
    ranked = counts.most_common()
    if len(ranked) <= 1:
        head = ranked[0][0].label() if ranked else "no module quantized"
        return head + (f" ({kept[0]})" if kept else "")
    widths = "/".join(str(bits) for bits in sorted({spec.bits for spec, _ in ranked}))
    parts = [f"{n} module{'s' * (n > 1)} {spec.label()}" for spec, n in ranked]
    return f"mixed {widths}-bit: " + "; ".join(parts + kept)
