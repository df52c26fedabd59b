"""Quantizing a loaded model the way ``mlx_lm.convert -q`` does, for ``turbospark import --quantize``.

The model is the family's own, loaded through ``turbospark_load_model`` (so the
family's sanitize has applied), and its parameters are saved under their
names: those are mlx-lm's names, or names mlx-lm's sanitize maps onto its own,
so the checkpoint loads in mlx-lm and in turbospark alike.

Which modules are quantized follows mlx-lm's rule (``mlx_lm.utils.quantize_model``):
every module with a quantized form (``to_quantized``: linear layers,
embeddings) whose input width the group size divides, with the settings the
family's :func:`~turbospark.contract.hookspecs.turbospark_quantize_overrides`
gives by path suffix (mlx-lm's ``quant_predicate``: gemma4 keeps its MoE
router at 8 bits in groups of 64). A module left in floating point is
recorded as ``false`` in the config block, so a reader need not infer it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from pydantic import ValidationError
from tqdm import tqdm

from turbospark.errors import InstallError
from turbospark.loading.checkpoint_config import describe
from turbospark.loading.quantization import AFFINE_BITS, FIXED, Quantization, QuantSpec

# Group sizes MLX's affine kernels take (mx.quantize refuses others).
AFFINE_GROUPS = (32, 64, 128)
DEFAULT_AFFINE_GROUP = 64  # mlx_lm.convert's --q-group-size default


def requested_spec(bits: int, group_size: int | None = None, mode: str = "affine") -> QuantSpec:
    """The settings ``--quantize BITS [--group-size N] [--mode M]`` ask for, refused
    with the flags that fix them when MLX cannot pack them."""
    if mode in FIXED:
        fixed_bits, fixed_group = FIXED[mode]
        if bits != fixed_bits or group_size not in (None, fixed_group):
            raise InstallError(
                f"--mode {mode} packs {fixed_bits} bits in groups of {fixed_group}; "
                f"pass --quantize {fixed_bits} and leave out --group-size"
            )
        group_size = fixed_group
    elif mode != "affine":
        raise InstallError(f"--mode {mode!r} is not one of affine, {', '.join(FIXED)}")
    elif bits not in AFFINE_BITS:
        raise InstallError(
            f"--quantize {bits}: affine quantization packs "
            f"{', '.join(map(str, AFFINE_BITS))} bits; pass one of those"
        )
    group_size = DEFAULT_AFFINE_GROUP if group_size is None else group_size
    if mode == "affine" and group_size not in AFFINE_GROUPS:
        raise InstallError(
            f"--group-size {group_size} is not one MLX packs; "
            f"pass one of {', '.join(map(str, AFFINE_GROUPS))}"
        )
    return QuantSpec(group_size=group_size, bits=bits, mode=mode).check()  # type: ignore[arg-type]


def overrides_of(raw: dict[str, Any] | None, family: str) -> dict[str, QuantSpec | bool]:
    """A family's ``turbospark_quantize_overrides``, validated (pydantic at the boundary)."""
    out: dict[str, QuantSpec | bool] = {}
    for suffix, value in (raw or {}).items():
        if isinstance(value, bool):
            out[suffix] = value
            continue
        try:
            out[suffix] = QuantSpec.model_validate(value).check()
        except ValidationError as exc:
            raise InstallError(
                f"family {family}'s quantize override for {suffix!r} is malformed "
                f"({describe(exc)}); it should be {{'bits': B, 'group_size': G}} or false"
            ) from exc
    return out


def _setting(
    path: str, module: nn.Module, spec: QuantSpec, overrides: dict[str, QuantSpec | bool]
) -> QuantSpec | None:
    """What mlx-lm's ``wrapped_predicate`` gives *module*: None keeps it in floating
    point (no quantized form, or the group size does not divide its input width)."""
    if module.weight.shape[-1] % spec.group_size:
        return None
    chosen = next((v for k, v in overrides.items() if path.endswith(k)), True)
    if chosen is False:
        return None
    return spec if chosen is True else chosen


def quantize_model(
    model: nn.Module,
    spec: QuantSpec,
    overrides: dict[str, QuantSpec | bool] | None = None,
    *,
    progress: bool = False,
) -> Quantization:
    """Quantize *model* in place with *spec* (and *overrides* by path suffix);
    returns the config block that describes the result."""
    candidates = [
        (path, module)
        for path, module in model.named_modules()
        if hasattr(module, "to_quantized") and hasattr(module, "weight")
    ]
    chosen = {path: _setting(path, m, spec, overrides or {}) for path, m in candidates}
    if candidates and not any(chosen.values()):
        widths = sorted({m.weight.shape[-1] for _, m in candidates})
        raise InstallError(
            f"group size {spec.group_size} divides the input width of no module "
            f"(widths {', '.join(map(str, widths[:8]))}); pass a --group-size that divides them"
        )
    quantized: list[tuple[str, nn.Module]] = []
    with tqdm(total=len(candidates), unit="module", desc="quantize", disable=not progress) as bar:
        for path, module in candidates:
            setting = chosen[path]
            if setting is not None:
                packed = module.to_quantized(
                    group_size=setting.group_size, bits=setting.bits, mode=setting.mode
                )
                mx.eval(packed.parameters())  # one module at a time bounds the peak memory
                quantized.append((path, packed))
            bar.update()
    if quantized:
        model.update_modules(tree_unflatten(quantized))
    block: dict[str, QuantSpec | bool] = {
        path: (False if setting is None else setting)
        for path, setting in chosen.items()
        if setting != spec
    }
    return Quantization(default=spec, overrides=block)  # type: ignore[arg-type]


def quantized_weights(
    model: nn.Module,
    config: dict[str, Any],
    spec: QuantSpec,
    overrides: dict[str, QuantSpec | bool],
    *,
    progress: bool = False,
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Quantize the loaded *model* and return its parameters under their names,
    with *config* plus mlx-lm's block (``quantization`` and its copy
    ``quantization_config``, which transformers reads): what an install holds."""
    block = quantize_model(model, spec, overrides, progress=progress).to_config()
    weights = dict(tree_flatten(model.parameters()))
    return weights, {**config, "quantization": block, "quantization_config": block}


def describe_block(block: Quantization | None) -> str:
    """One phrase for a checkpoint's config block, read without its weights:
    ``4-bit affine, group 64 (1 module 8-bit affine, group 64; 2 in floating point)``."""
    if block is None:
        return "not quantized"
    kept = sum(1 for v in block.overrides.values() if v is False)
    others: dict[QuantSpec, int] = {}
    for value in block.overrides.values():
        if value is not False and value != block.default:
            others[value] = others.get(value, 0) + 1
    parts = [f"{n} module{'s' * (n > 1)} {s.label()}" for s, n in others.items()]
    parts += [f"{kept} in floating point"] if kept else []
    return block.default.label() + (f" ({'; '.join(parts)})" if parts else "")
