"""``turbospark import``: a Hugging Face checkpoint directory -> a turbospark install.

The install stays a Hugging Face checkpoint (same ``config.json``, same tensor
names, same tokenizer files), so mlx-lm loads it unchanged; the import adds the
validated arch, the family and every file's sha256 in ``manifest.json``, and
optionally casts the weights. The family is found by ``model_type`` (the
text config's, when ``config.json`` nests one under ``text_config``); the
config is read by :mod:`turbospark.loading.checkpoint_config` (the same reading every later
open does) and validated by the family's ``ArchConfig`` before any tensor is
read, and every tensor is checked against it before anything is written.

A checkpoint mlx-lm quantized imports unchanged (its packed tensors and its
``quantization`` block are kept as they are). With ``quantize=`` the import
quantizes the model the family loaded (:mod:`turbospark.loading.convert`) and
writes its parameters with mlx-lm's config block, so mlx-lm loads the result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from pydantic import BaseModel, ConfigDict, ValidationError
from tqdm import tqdm

from turbospark.contract.hookspecs import ArchConfig
from turbospark.errors import InstallError
from turbospark.loading.checkpoint_config import HFConfig, arch_from_config, read_config
from turbospark.loading.convert import overrides_of, quantized_weights, requested_spec
from turbospark.loading.install import Manifest, write_install
from turbospark.loading.plugins import FamilyRegistry, default_registry
from turbospark.loading.quantization import Quantization, QuantSpec

# Files beside the weights that the install carries over unchanged.
TEXT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
)
DTYPES = ("bfloat16", "float16", "float32")
SHARD_BYTES = 5 * 1024**3  # Hugging Face's default shard size


class WeightIndex(BaseModel):
    """``model.safetensors.index.json``."""

    model_config = ConfigDict(extra="allow")

    weight_map: dict[str, str]


def resolve_arch(config: HFConfig, family: str | None, registry: FamilyRegistry) -> ArchConfig:
    """The checkpoint's arch, validated by the family that loads it (*family*
    overrides the lookup by ``model_type``)."""
    model_type = config.text_model_type
    if family is not None:
        fam = registry.get(family)
    elif model_type is None:
        raise InstallError(
            "config.json has no model_type; pass --family to say which family loads it "
            f"({registry.describe_installed()})"
        )
    else:
        fam = registry.for_model_type(model_type)
    return arch_from_config(config, fam.spec.arch_config, fam.name)


def weight_files(hf_dir: Path) -> list[Path]:
    """The shards an index names, or every ``*.safetensors`` without one."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            parsed = WeightIndex.model_validate(json.loads(index.read_text()))
        except (json.JSONDecodeError, ValidationError) as exc:
            raise InstallError(f"{index} is malformed: {exc}") from exc
        files = [hf_dir / name for name in sorted(set(parsed.weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InstallError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise InstallError(
            f"no .safetensors files in {hf_dir}; only safetensors checkpoints import"
        )
    return files


def read_weights(files: list[Path], dtype: str | None, progress: bool) -> dict[str, mx.array]:
    """Every tensor, cast to *dtype* when given (floating tensors only)."""
    target = getattr(mx, dtype) if dtype is not None else None
    shards = [mx.load(str(f)) for f in files]
    weights: dict[str, mx.array] = {}
    with tqdm(total=sum(len(s) for s in shards), unit="tensor", disable=not progress) as bar:
        for file, shard in zip(files, shards, strict=True):
            bar.set_description(file.name)
            for name, value in shard.items():
                if name in weights:
                    raise InstallError(f"tensor {name} appears in more than one shard")
                if target is not None and mx.issubdtype(value.dtype, mx.floating):
                    value = value.astype(target)
                mx.eval(value)
                weights[name] = value
                bar.update()
    return weights


def import_checkpoint(
    hf_dir: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    family: str | None = None,
    model_id: str | None = None,
    registry: FamilyRegistry | None = None,
    progress: bool = True,
    quantize: QuantSpec | None = None,
) -> Manifest:
    """Import the checkpoint at *hf_dir* as an install at *out* (which must not
    hold anything yet), quantized with *quantize* when given; returns the
    written manifest."""
    src, dst = Path(hf_dir), Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise InstallError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if dst.exists() and any(dst.iterdir()):
        raise InstallError(f"{dst} is not empty; import into a new directory")
    config = read_config(src / "config.json")
    reg = registry or default_registry()
    arch = resolve_arch(config, family, reg)
    raw_config = json.loads((src / "config.json").read_text())
    weights = read_weights(weight_files(src), dtype, progress)
    if quantize is not None:
        quantize = requested_spec(quantize.bits, quantize.group_size, quantize.mode)
        refuse_requantizing(src, raw_config, weights)
    model = check_weights(arch, weights, reg)
    if quantize is not None:
        overrides = reg.get(arch.family).manager().hook.turbospark_quantize_overrides(arch=arch)
        weights, raw_config = quantized_weights(
            model, raw_config, quantize, overrides_of(overrides, arch.family), progress=progress
        )
    extra = {name: (src / name).read_bytes() for name in TEXT_FILES if (src / name).is_file()}
    try:
        return write_install(
            dst,
            arch=arch,
            model_id=model_id or src.resolve().name,
            weights=weights,
            config=raw_config,
            extra_files=extra,
            shard_bytes=SHARD_BYTES,
        )
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)  # never leave a half-written install
        raise


def refuse_requantizing(src: Path, config: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """``--quantize`` on a quantized checkpoint would pack packed weights: refuse it."""
    block = Quantization.from_config(config)
    packed = next((name for name in weights if name.endswith(".scales")), None)
    if block is not None or packed is not None:
        what = block.default.label() if block is not None else f"{packed} is packed"
        raise InstallError(
            f"{src} is already quantized ({what}); import it without --quantize, "
            "or quantize its floating-point original"
        )


def check_weights(
    arch: ArchConfig, weights: dict[str, mx.array], registry: FamilyRegistry
) -> nn.Module:
    """Load *weights* into the family's model once, as ``Runner.open`` will, so a
    missing, unexpected or mis-shaped tensor is refused by name before anything
    is written (never an import that succeeds and an install that does not open).
    The weights keep their dtype, so the check costs what serving costs; returns
    the loaded model."""
    floating = [v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    dtype = mx.bfloat16 if mx.bfloat16 in floating else (floating or [mx.float32])[0]
    hook = registry.get(arch.family).manager().hook
    return hook.turbospark_load_model(arch=arch, weights=weights, dtype=dtype, experts=None)
