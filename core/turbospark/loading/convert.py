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

Routed experts (an :class:`~turbospark.layers.experts.ExpertLayer`'s stacked
``(E, out, in)`` tables) are packed by the same rule and written as mlx-lm
writes its ``SwitchGLU``: ``<layer>.switch_glu.<projection>.weight`` beside
its ``scales`` and ``biases``, the one layout of packed experts mlx-lm reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from pydantic import ValidationError
from tqdm import tqdm

from turbospark.errors import InstallError
from turbospark.layers.experts import ExpertLayer
from turbospark.loading.checkpoint_config import describe
from turbospark.loading.quantization import (
    AFFINE_BITS,
    FIXED,
    Quantization,
    QuantSpec,
    describe_counts,
)

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
    path: str, width: int, spec: QuantSpec, overrides: dict[str, QuantSpec | bool]
) -> QuantSpec | None:
    """What mlx-lm's ``wrapped_predicate`` gives the module at *path* whose input
    is *width* wide: None keeps it in floating point (the group size does not
    divide its width, or the family says so)."""
    if width % spec.group_size:
        return None
    chosen = next((v for k, v in overrides.items() if path.endswith(k)), True)
    if chosen is False:
        return None
    return spec if chosen is True else chosen


def _overridden(path: str, overrides: dict[str, QuantSpec | bool]) -> bool:
    """Whether the family names *path*'s packing (recorded even when it is the
    default, as mlx-lm records whatever its ``quant_predicate`` returns)."""
    return any(path.endswith(k) and v is not True for k, v in overrides.items())


def quantize_model(
    model: nn.Module,
    spec: QuantSpec,
    overrides: dict[str, QuantSpec | bool] | None = None,
    *,
    progress: bool = False,
) -> Quantization:
    """Quantize *model*'s linear layers and embeddings in place with *spec* (and
    *overrides* by path suffix); returns the config block that describes them."""
    candidates = [
        (path, module)
        for path, module in model.named_modules()
        if hasattr(module, "to_quantized") and hasattr(module, "weight")
    ]
    chosen = {
        path: _setting(path, m.weight.shape[-1], spec, overrides or {}) for path, m in candidates
    }
    widths = {m.weight.shape[-1] for _, m in candidates} | {
        table.shape[-1] for _, table in _expert_tables(model)
    }
    if widths and all(width % spec.group_size for width in widths):
        raise InstallError(
            f"group size {spec.group_size} divides the input width of no module "
            f"(widths {', '.join(map(str, sorted(widths)[:8]))}); pass a --group-size "
            "that divides them"
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
        if setting != spec or _overridden(path, overrides or {})
    }
    return Quantization(default=spec, overrides=block)  # type: ignore[arg-type]


def _expert_tables(model: nn.Module) -> list[tuple[str, mx.array]]:
    """Every resident stacked expert table, by its ``switch_glu`` module path."""
    return [
        (f"{path}.switch_glu.{name}", module[name])
        for path, module in model.named_modules()
        if isinstance(module, ExpertLayer)
        for name in module.projections
        if name in module
    ]


def _packed_experts(
    model: nn.Module, spec: QuantSpec, overrides: dict[str, QuantSpec | bool]
) -> tuple[dict[str, mx.array], dict[str, QuantSpec | bool]]:
    """The expert tables as mlx-lm's converter writes them (``switch_glu``), packed
    where the rule packs them, with the block's entries for those it does not."""
    tensors: dict[str, mx.array] = {}
    block: dict[str, QuantSpec | bool] = {}
    for path, table in _expert_tables(model):
        setting = _setting(path, table.shape[-1], spec, overrides)
        if setting is None:
            tensors[f"{path}.weight"] = table
            block[path] = False
            continue
        words, scales, *biases = mx.quantize(
            table, group_size=setting.group_size, bits=setting.bits, mode=setting.mode
        )
        tensors |= {f"{path}.weight": words, f"{path}.scales": scales}
        tensors |= {f"{path}.biases": b for b in biases if b is not None}
        mx.eval(list(tensors.values()))
        if setting != spec or _overridden(path, overrides):
            block[path] = setting
    return tensors, block


def quantized_weights(
    model: nn.Module,
    config: dict[str, Any],
    spec: QuantSpec,
    overrides: dict[str, QuantSpec | bool],
    *,
    progress: bool = False,
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Quantize the loaded *model* and return its parameters under their names
    (routed experts under mlx-lm's), with *config* plus mlx-lm's block
    (``quantization`` and its copy ``quantization_config``, which transformers
    reads): what an install holds."""
    described = quantize_model(model, spec, overrides, progress=progress)
    experts, expert_block = _packed_experts(model, spec, overrides)
    layers = {path.rsplit(".switch_glu.", 1)[0] for path in expert_block} | {
        name.rsplit(".switch_glu.", 1)[0] for name in experts
    }
    weights = {
        name: value
        for name, value in tree_flatten(model.parameters())
        if name.rsplit(".", 1)[0] not in layers
    }
    block = Quantization(
        default=spec,
        overrides={**described.overrides, **expert_block},  # type: ignore[dict-item]
    ).to_config()
    return weights | experts, {**config, "quantization": block, "quantization_config": block}


def describe_block(block: Quantization | None, stored: Collection[str] | None) -> str:
    """One phrase for a checkpoint's packing, from its config block and the
    module paths its tensors store quantized (*stored*: those with ``scales``,
    read from the safetensors headers), no weight read: each stored module at
    its override, else the block's default, as mlx-lm loads it
    (:func:`~turbospark.loading.quantization.describe_counts`). The default
    alone would be wrong for a mixed recipe, whose every module has an
    override and whose default (``--q-bits``) may be a width no module has;
    so where there are no tensors to count (*stored* None) it is named as the
    default, beside the overrides the block lists."""
    if block is None:
        return "not quantized"
    kept = sum(1 for v in block.overrides.values() if v is False)
    if stored is None:
        listed = Counter(v for v in block.overrides.values() if v not in (False, block.default))
        parts = [f"{n} module{'s' * (n > 1)} {spec.label()}" for spec, n in listed.most_common()]
        parts += [f"{kept} in floating point"] if kept else []
        return f"{block.default.label()} by default" + (f" ({'; '.join(parts)})" if parts else "")
    counts: Counter[QuantSpec] = Counter()
    for path in stored:
        spec = block.overrides.get(path, block.default)
        if spec is not False:
            counts[spec] += 1
    return describe_counts(counts, kept)
