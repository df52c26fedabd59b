"""The install format: a Hugging Face checkpoint directory plus our manifest.

An install is ``config.json`` (the HF config, so mlx-lm loads the same
directory), ``*.safetensors`` with HF tensor names, optional tokenizer files,
and ``manifest.json``: format version, family, model id, validated arch and
every file's size and sha256. Synthetic installs and real imports both go
through :func:`write_install`, so the tests exercise the real loading path.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from turbospark.contract.hookspecs import ArchConfig
from turbospark.errors import InstallError
from turbospark.loading.checkpoint_config import arch_from_config, describe, read_config
from turbospark.loading.convert import overrides_of, quantized_weights
from turbospark.loading.quantization import QuantSpec, quantize_like

if TYPE_CHECKING:
    from turbospark.loading.plugins import FamilyRegistry

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    """``manifest.json``: what the install is and what its files must hash to."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1]
    family: str
    model_id: str
    dtype: str
    arch: dict[str, Any]
    files: dict[str, FileEntry]

    @property
    def weight_files(self) -> list[str]:
        return sorted(name for name in self.files if name.endswith(".safetensors"))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of *manifest* canonically serialised: it holds every file's sha256,
    so other weights (or another arch, family or model id) digest differently.
    What parked sessions on disk and a group of processes identify a model by."""
    return hashlib.sha256(manifest.model_dump_json().encode()).hexdigest()


def read_manifest(path: str | Path) -> Manifest:
    """Parse and validate ``manifest.json``; every failure names the file and field."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise InstallError(
            f"{file} not found: {path} is not a turbospark install "
            "(build one with `turbospark import HF_DIR OUT` or build_synthetic_install)"
        )
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise InstallError(f"{file} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise InstallError(f"{file} is malformed: {describe(exc)}") from exc


def validate_arch(path: str | Path, manifest: Manifest, arch_cls: type[ArchConfig]) -> ArchConfig:
    """The install's arch, read from its ``config.json`` exactly as the import read
    it; ``manifest.json`` records the same arch, and an install where the two
    disagree (written by an older import, or edited) is refused by field."""
    source = Path(path) / MANIFEST
    try:
        recorded = arch_cls.model_validate({**manifest.arch, "family": manifest.family})
    except ValidationError as exc:
        raise InstallError(
            f"{source}: arch does not fit family '{manifest.family}': {describe(exc)}"
        ) from exc
    config = Path(path) / "config.json"
    if not config.is_file():
        raise InstallError(f"{config} is listed in {MANIFEST} but missing; re-run the import")
    arch = arch_from_config(read_config(config), arch_cls, manifest.family)
    if arch != recorded:
        field = next(k for k in type(arch).model_fields if getattr(arch, k) != getattr(recorded, k))
        raise InstallError(
            f"{source} records arch.{field}={getattr(recorded, field)!r} but config.json gives "
            f"{getattr(arch, field)!r}; re-run `turbospark import` to rewrite the install"
        )
    return arch


def peek_manifest_arch(path: str | Path, registry: FamilyRegistry | None = None) -> ArchConfig:
    """The install's validated arch, without touching its weights."""
    from turbospark.loading.plugins import default_registry

    manifest = read_manifest(path)
    family = (registry or default_registry()).get(manifest.family)
    return validate_arch(path, manifest, family.spec.arch_config)


def check_sizes(path: str | Path, manifest: Manifest) -> None:
    """Every listed file exists with the recorded size: checked before any hashing."""
    root = Path(path)
    for name, entry in manifest.files.items():
        file = root / name
        if not file.is_file():
            raise InstallError(f"{file} is listed in {MANIFEST} but missing; re-run the import")
        size = file.stat().st_size
        if size != entry.size:
            raise InstallError(
                f"{file} is {size} bytes but {MANIFEST} records {entry.size}: "
                "the file was truncated or replaced; re-run the import"
            )


def check_digest(path: str | Path, manifest: Manifest, name: str, digest: str) -> None:
    """File *name* hashed to *digest*: refuse it unless that is what the manifest records."""
    file, entry = Path(path) / name, manifest.files[name]
    if digest != entry.sha256:
        raise InstallError(
            f"{file} sha256 mismatch: {MANIFEST} records {entry.sha256[:12]}…, "
            f"the file hashes to {digest[:12]}…; the file is corrupt, re-run the import"
        )


def load_weights(path: str | Path, manifest: Manifest) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for name in manifest.weight_files:
        weights.update(mx.load(str(Path(path) / name)))
    if not weights:
        raise InstallError(f"{Path(path) / MANIFEST} lists no .safetensors file")
    return weights


def safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's tensors (name -> dtype, shape, offsets) from its JSON
    header alone (no tensor is read); a file that is none is refused by name."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InstallError(f"{file} is not a safetensors file ({exc}); re-download it") from exc
    header.pop("__metadata__", None)
    return header


def stored_quantized(directory: Path) -> set[str] | None:
    """The module paths whose tensors the directory's safetensors files store
    quantized (a ``scales`` beside the packed weight), from their headers
    alone; None when it holds no safetensors file to read."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    return {
        name.removesuffix(".scales")
        for file in files
        for name in safetensors_header(file)
        if name.endswith(".scales")
    }


def tensor_names(path: str | Path, manifest: Manifest) -> set[str]:
    """Every tensor name the install's safetensors files hold, from their
    headers alone: cheap checks before a load."""
    names: set[str] = set()
    for name in manifest.weight_files:
        names.update(safetensors_header(Path(path) / name))
    return names


def load_checked(model: nn.Module, weights: dict[str, mx.array], dtype: mx.Dtype) -> nn.Module:
    """Load HF-named *weights* into *model*, refusing missing, unexpected or
    mis-shaped tensors by name, then cast floating parameters to *dtype*.

    Modules the checkpoint stores quantized (mlx-lm's layout: packed ``weight``
    beside ``scales`` and ``biases``) become quantized modules first, with the
    settings their tensors were packed with (:mod:`turbospark.loading.quantization`)."""
    quantize_like(model, weights)
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise InstallError(
            f"missing tensor(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''} "
            "in the install's safetensors; the checkpoint does not match its config.json"
        )
    unexpected = sorted(set(weights) - set(expected))
    if unexpected and all(name.endswith((".scales", ".biases")) for name in unexpected):
        raise InstallError(
            f"tensor(s) {', '.join(unexpected[:5])} quantize a parameter that this family keeps "
            "in floating point; convert the checkpoint leaving those modules unquantized"
        )
    if unexpected:
        raise InstallError(
            f"unexpected tensor(s) {', '.join(unexpected[:5])} in the install's safetensors; "
            "the checkpoint does not match its config.json"
        )
    for name, value in weights.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise InstallError(
                f"tensor {name} has shape {tuple(value.shape)}, config.json implies "
                f"{tuple(expected[name].shape)}; the checkpoint does not match its config"
            )
    # Tensors already in *dtype* are loaded as they are (no copy: the import's check relies on it).
    cast = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype else v
        for k, v in weights.items()
    }
    model.load_weights(list(cast.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def write_install(
    path: str | Path,
    *,
    arch: ArchConfig,
    model_id: str,
    weights: dict[str, mx.array],
    config: dict[str, Any] | None = None,
    extra_files: dict[str, str | bytes] | None = None,
    shard_bytes: int | None = None,
) -> Manifest:
    """Write an install: config.json, safetensors (sharded past *shard_bytes*),
    extra files (tokenizer, chat template), then the manifest over all of them."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or arch.hf_config(), indent=2) + "\n")
    names = _write_shards(root, weights, shard_bytes)
    for name, content in (extra_files or {}).items():
        target = root / name
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    dtypes = {str(v.dtype).removeprefix("mlx.core.") for v in weights.values()}
    listed = ["config.json", *names, *(extra_files or {})]
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        family=arch.family,
        model_id=model_id,
        dtype="bfloat16" if "bfloat16" in dtypes else sorted(dtypes)[0],
        arch=arch.model_dump(mode="json", exclude={"family"}),
        files={
            name: FileEntry(size=(root / name).stat().st_size, sha256=sha256_file(root / name))
            for name in listed
        },
    )
    (root / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
    return manifest


def _write_shards(root: Path, weights: dict[str, mx.array], shard_bytes: int | None) -> list[str]:
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name in sorted(weights):
        value = weights[name]
        if shard_bytes and shards[-1] and size + value.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(root / "model.safetensors"), shards[0], metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = {"metadata": {}, "weight_map": {}}
    for name, shard in zip(names, shards, strict=True):
        mx.save_safetensors(str(root / name), shard, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(shard, name))
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*names, "model.safetensors.index.json"]


def build_synthetic_install(
    family: str,
    path: str | Path,
    *,
    registry: FamilyRegistry | None = None,
    quantize: QuantSpec | None = None,
    **dims: Any,
) -> ArchConfig:
    """A random-weight install of *family* at *path*, built by the family's own hook.

    *dims* are the family's size knobs (``vocab_size``, ``num_layers``, ``seed``,
    ``model_id``, ``dtype`` ...); unknown ones are refused by the family. With
    *quantize*, the install is built in floating point, loaded by the family and
    quantized by the converter ``turbospark import --quantize`` runs
    (:func:`turbospark.loading.convert.quantized_weights`), so tests and the
    kit get quantized installs as cheaply as floating ones.
    """
    from turbospark.loading.plugins import default_registry

    reg = registry or default_registry()
    hook = reg.get(family).manager().hook
    if quantize is None:
        return hook.turbospark_build_synthetic_install(path=Path(path), dims=dims)
    with tempfile.TemporaryDirectory() as tmp:
        arch = hook.turbospark_build_synthetic_install(path=Path(tmp), dims=dims)
        manifest = read_manifest(tmp)
        model = hook.turbospark_load_model(
            arch=arch,
            weights=load_weights(tmp, manifest),
            dtype=getattr(mx, manifest.dtype),
            experts=None,
        )
        raw = hook.turbospark_quantize_overrides(arch=arch)
        weights, config = quantized_weights(
            model,
            json.loads((Path(tmp) / "config.json").read_text()),
            quantize.check(),
            overrides_of(raw, family),
        )
        kept = [n for n in manifest.files if n != "config.json" and not _is_weight_file(n)]
        write_install(
            path,
            arch=arch,
            model_id=manifest.model_id,
            weights=weights,
            config=config,
            extra_files={name: (Path(tmp) / name).read_bytes() for name in kept},
        )
    return arch


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name == "model.safetensors.index.json"
