"""Where a model comes from: an install, a plain checkpoint directory, or a hub id.

Every opener (``Runner.open``, the CLI commands, the conformance kit) resolves
what the user named through :func:`resolve_source`, the way mlx-lm's
``--model`` takes a directory or a Hugging Face repo id:

- a directory with ``manifest.json`` is an install; ``Runner.open`` checks its
  files against the manifest's sha256 (:func:`verify_install`), hashing only
  those the record below does not vouch for;
- any other directory with ``config.json`` and safetensors is a checkpoint,
  served where it lies: its weights are never copied;
- ``org/name`` that is not a local path is a hub id, resolved by
  ``huggingface_hub.snapshot_download`` (its cache, its progress bars,
  ``HF_HUB_OFFLINE=1`` honoured); a local path always wins over an id.

A checkpoint has no manifest of its own, so one is synthesized: the family
found by ``model_type``, the arch that family validates from ``config.json``,
and every file's size and sha256. Hashing a large checkpoint takes a while, so
it is done once and remembered in a record *outside* the directory (a hub
snapshot belongs to the hub's cache and may be read-only): one JSON file per
resolved directory under :func:`cache_root`. A later open compares each
file's size and ``mtime_ns`` with the record and hashes only files that
differ, were added or were removed, saying so in a warning. A rewrite that
keeps both size and mtime is not seen (docs/IMPORT.md says so).

An install is remembered the same way: a file whose size and ``mtime_ns`` match
the record, and whose recorded sha256 is the one its manifest names, is not
hashed again. Hashing is most of an open of a large install (about 10 s for
16 GB), and a server restart should not pay it each time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm import tqdm

from turbospark.errors import InstallError
from turbospark.loading.checkpoint_config import read_config
from turbospark.loading.importer import TEXT_FILES, resolve_arch, weight_files
from turbospark.loading.install import (
    FORMAT_VERSION,
    MANIFEST,
    FileEntry,
    Manifest,
    check_digest,
    check_sizes,
    read_manifest,
    safetensors_header,
    sha256_file,
)
from turbospark.loading.plugins import FamilyRegistry, default_registry
from turbospark.paths import cache_root

log = logging.getLogger(__name__)

SourceKind = Literal["install", "checkpoint", "hub"]
INDEX = "model.safetensors.index.json"
# What a hub download fetches: the config, weights and text files, never *.bin or *.pth.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# safetensors header dtypes -> MLX names, floating ones in the order a compute dtype is chosen.
_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: the directory it lies in, what kind it was and its manifest
    (an install's own; a checkpoint's synthesized from verified files)."""

    requested: str
    path: Path
    kind: SourceKind
    manifest: Manifest

    def describe(self) -> str:
        """One phrase for logs and startup lines: what was opened, and where."""
        if self.kind == "hub":
            return f"hub id {self.requested} ({self.path})"
        return f"{self.kind} {self.path}"


class RecordedFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    size: int = Field(ge=0)
    mtime_ns: int
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class CheckpointRecord(BaseModel):
    """What a checkpoint's (or an install's) files hashed to, and the size and
    mtime they had then."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1] = 1
    directory: str
    files: dict[str, RecordedFile]


def record_path(directory: Path) -> Path:
    """The record of *directory* (resolved): one file per directory, named by its path."""
    key = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:32]
    return cache_root() / "checkpoints" / f"{key}.json"


def is_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and ".." not in text


def resolve_source(
    model: str | Path | ModelSource,
    *,
    registry: FamilyRegistry | None = None,
    progress: bool = True,
) -> ModelSource:
    """Resolve *model* (an install or checkpoint directory, or a hub id) to a
    directory and its manifest; a checkpoint's files are verified here (hashed
    once, then checked by size and mtime)."""
    if isinstance(model, ModelSource):
        return model
    requested = str(model)
    local = Path(model).expanduser()
    hub_id = None
    if local.exists():
        if not local.is_dir():
            raise InstallError(
                f"{local} is a file; pass the directory holding config.json and the safetensors"
            )
        directory = local
    elif is_hub_id(requested):
        hub_id = requested
        directory = download(requested)
    else:
        raise InstallError(
            f"{requested}: no such directory, and not a Hugging Face repo id (org/name); "
            "pass an install, a checkpoint directory or a hub id"
        )
    if (directory / MANIFEST).is_file():
        return ModelSource(requested, directory, "install", read_manifest(directory))
    if not (directory / "config.json").is_file():
        raise InstallError(
            f"{directory} is not a model: it has neither {MANIFEST} (an install) nor config.json "
            "(a Hugging Face checkpoint); pass a checkpoint directory or a hub id (org/name)"
        )
    model_id = hub_id or hub_id_of_snapshot(directory) or directory.resolve().name
    manifest = verify_checkpoint(directory, model_id, registry=registry, progress=progress)
    return ModelSource(requested, directory, "hub" if hub_id else "checkpoint", manifest)


def download(repo_id: str) -> Path:
    """The hub snapshot of *repo_id*: fetched (with progress) or found in the cache."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    # Read at call time too: huggingface_hub reads the variable once, at import.
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {
        "1",
        "ON",
        "YES",
        "TRUE",
    }
    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=HUB_PATTERNS,
                cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                local_files_only=offline,
            )
        )
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise InstallError(
            f"{repo_id}: not a local directory and not in the Hugging Face cache ({why}); "
            "download it once online, or pass a checkpoint directory"
        ) from exc
    except GatedRepoError as exc:
        raise InstallError(
            f"{repo_id}: the repo is gated; accept its terms on huggingface.co and log in "
            "(`hf auth login`)"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise InstallError(
            f"{repo_id}: no such Hugging Face repo (or it is private: log in with `hf auth login`)"
        ) from exc
    except HfHubHTTPError as exc:
        raise InstallError(f"{repo_id}: the Hugging Face Hub refused the download: {exc}") from exc


def hub_id_of_snapshot(directory: Path) -> str | None:
    """``org/name`` when *directory* is a snapshot in the hub's cache layout
    (``models--org--name/snapshots/<commit>``), so a snapshot passed by path is
    served under the same id as the hub id that names it."""
    resolved = directory.resolve()
    repo = resolved.parent.parent.name
    if resolved.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/", 1)


def checkpoint_files(directory: Path) -> list[str]:
    """The files a checkpoint's manifest covers: config.json, the weight shards
    (those the index names, else every ``*.safetensors``), the index, the text files."""
    try:
        shards = [f.name for f in weight_files(directory)]
    except InstallError as exc:
        raise InstallError(f"{exc}; {directory} is not a servable checkpoint") from exc
    extra = [name for name in (INDEX, *TEXT_FILES) if (directory / name).is_file()]
    return sorted({"config.json", *shards, *extra})


def verify_checkpoint(
    directory: Path,
    model_id: str,
    *,
    registry: FamilyRegistry | None = None,
    progress: bool = True,
) -> Manifest:
    """The checkpoint's manifest: arch validated by the family its ``model_type``
    names (before any hashing), files hashed only where the record is stale."""
    config = read_config(directory / "config.json")
    if config.text_model_type is None:
        raise InstallError(
            f"{directory / 'config.json'} has no model_type, so no family is found for it; "
            "import it with `turbospark import DIR OUT --family NAME` and serve OUT"
        )
    arch = resolve_arch(config, None, registry or default_registry())
    names = checkpoint_files(directory)
    stats = {name: (directory / name).stat() for name in names}
    record = load_record(directory)
    known = {} if record is None else record.files
    stale = unvouched(stats, known)
    removed = sorted(set(known) - set(names))
    if record is not None and (stale or removed):
        changes = [
            *(f"{n} ({'changed' if n in known else 'added'})" for n in stale),
            *(f"{n} (removed)" for n in removed),
        ]
        log.warning(
            "%s: %s since it was verified; re-hashing and updating the record",
            directory,
            ", ".join(changes),
        )
    files = {name: entry for name, entry in known.items() if name in names and name not in stale}
    if stale:
        files.update(hash_files(directory, stale, stats, progress))
    if stale or removed or record is None:
        save_record(CheckpointRecord(directory=str(directory.resolve()), files=files))
    return Manifest(
        format_version=FORMAT_VERSION,
        family=arch.family,
        model_id=model_id,
        dtype=checkpoint_dtype(directory, [n for n in names if n.endswith(".safetensors")]),
        arch=arch.model_dump(mode="json", exclude={"family"}),
        files={n: FileEntry(size=files[n].size, sha256=files[n].sha256) for n in names},
    )


def verify_install(directory: Path, manifest: Manifest, *, progress: bool = False) -> None:
    """Refuse an install whose files are missing, resized or do not hash to its
    manifest's sha256. A file the record saw at the same size and ``mtime_ns``
    with the sha256 the manifest names is trusted unhashed; the rest are hashed
    and, when they match, recorded for the next open."""
    check_sizes(directory, manifest)
    stats = {name: (directory / name).stat() for name in manifest.files}
    record = load_record(directory)
    known = {} if record is None else record.files
    digests = {name: entry.sha256 for name, entry in manifest.files.items()}
    stale = unvouched(stats, known, digests)
    if not stale:
        return
    hashed = hash_files(directory, stale, stats, progress)
    for name, entry in hashed.items():
        check_digest(directory, manifest, name, entry.sha256)
    files = {n: e for n, e in known.items() if n in manifest.files and n not in hashed}
    save_record(CheckpointRecord(directory=str(directory.resolve()), files={**files, **hashed}))


def unvouched(
    stats: dict[str, os.stat_result],
    known: dict[str, RecordedFile],
    digests: dict[str, str] | None = None,
) -> list[str]:
    """The files of *stats* the record (*known*) does not vouch for: never
    recorded, or recorded at another size or ``mtime_ns`` (or, given the
    *digests* they must have, with another sha256), so they must be hashed."""
    return [
        name
        for name, stat in stats.items()
        if name not in known
        or (known[name].size, known[name].mtime_ns) != (stat.st_size, stat.st_mtime_ns)
        or (digests is not None and known[name].sha256 != digests[name])
    ]


def hash_files(
    directory: Path, names: list[str], stats: dict[str, os.stat_result], progress: bool
) -> dict[str, RecordedFile]:
    total = sum(stats[n].st_size for n in names)
    hashed: dict[str, RecordedFile] = {}
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="verifying", disable=not progress
    ) as bar:
        for name in names:
            bar.set_postfix_str(name)
            digest = sha256_file(directory / name)
            after = (directory / name).stat()
            if (after.st_size, after.st_mtime_ns) != (
                stats[name].st_size,
                stats[name].st_mtime_ns,
            ):
                raise InstallError(
                    f"{directory / name} changed while it was being verified; "
                    "wait for the download or copy to finish and open it again"
                )
            hashed[name] = RecordedFile(
                size=after.st_size, mtime_ns=after.st_mtime_ns, sha256=digest
            )
            bar.update(after.st_size)
    return hashed


def load_record(directory: Path) -> CheckpointRecord | None:
    """The record of *directory*, or None when there is none or it cannot be
    trusted (then every file is hashed again, which is always safe)."""
    path = record_path(directory)
    try:
        record = CheckpointRecord.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        log.warning("%s: unreadable verification record (%s); verifying again", path, exc)
        return None
    return record if record.directory == str(directory.resolve()) else None


def save_record(record: CheckpointRecord) -> None:
    """Write *record* atomically; an unwritable cache costs a re-hash next time, not an error."""
    path = record_path(Path(record.directory))
    temp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp.write_text(record.model_dump_json(indent=2) + "\n")
        os.replace(temp, path)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        log.warning(
            "cannot write the verification record %s (%s): the next open hashes the "
            "checkpoint again; set TURBOSPARK_CACHE to a writable directory",
            path,
            exc,
        )


def checkpoint_dtype(directory: Path, shards: list[str]) -> str:
    """The compute dtype: the checkpoint's floating dtype (bfloat16 first, as an
    import records it), read from the safetensors headers alone."""
    found: set[str] = set()
    for name in shards:
        found.update(v["dtype"] for v in safetensors_header(directory / name).values())
    return next((mlx for st, mlx in _FLOAT_DTYPES.items() if st in found), "float32")
