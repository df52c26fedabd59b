"""The session file: one conversation's whole state on disk, verifiable and atomic.

A session file is a safetensors file. Its tensors are every state component's
arrays (``state/<component>/<key>``) and every prompt-boundary checkpoint
(``checkpoint/<i>/<component>/<key>``), exactly what the family's snapshot
hooks return, so a loaded session resumes bit for bit. Its metadata holds one
entry, ``turbospark``: the JSON of :class:`SessionMeta` (token ids, the model
it was built under, vision taint, steering identity, checkpoint positions and
a sha256 of all of it).

Why each field:

* **token ids**: reuse decisions compare a prompt with the ids a session was
  actually fed (SEMANTICS.md); a cache without them (mlx-lm's prompt cache
  files) cannot prove a match.
* **model identity** (family, a sha256 of the install's manifest, the dtype
  the runner computes in, its steering and its K/V quantization): a state is
  meaningless under other weights, so a file is never loaded into a
  different model; K/V quantized under one ``--kv-bits``/``--kv-group-size``
  are other arrays than another's, so a file is never mixed into a runner of
  another setting (refused as ``kv_quantization_differs``, naming the flags
  that would load it).
* **checkpoints**: without them a recurrent (GDN) session could only resume
  when the next prompt extends its record exactly; llama.cpp's slot files
  drop them and then re-prefill everything.
* **sha256** over the metadata and every tensor's name, dtype, shape and the
  sha256 of its bytes: a flipped byte or a torn file is refused instead of
  served. Hashing each tensor on its own lets the tensors hash in parallel
  threads (hashlib releases the GIL) while the arrays are built, so verifying
  a 281 MB session costs a fraction of reading it, not a serial pass over every
  byte (format version 1 hashed the bytes in one stream; such files still load).

Writes go to a temporary file that is fsynced, renamed over the target and
followed by an fsync of the directory, so a ``kill -9`` at any moment leaves
either the old file or the new one. The header alone (:func:`read_meta`) is
enough to index a file; :func:`read_session` maps the file once, hashes its
tensors in threads while other threads copy them into MLX arrays, and returns
nothing unverified.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from turbospark.errors import TurbosparkError
from turbospark.loading.install import Manifest, manifest_digest
from turbospark.sessions.session import Checkpoint, SessionSnapshot
from turbospark.state.kv import KVQuantization, describe_kv

SUFFIX = ".safetensors"
META_KEY = "turbospark"
_MAX_HEADER = 64 << 20  # a header past this is not ours (a 16k-token record is ~100 KB)
VERSION = 2
# bytes per element of each safetensors dtype (to check a header before hashing)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
             "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}  # fmt: skip
# Tensors hash in these threads; hashlib releases the GIL for large buffers.
_HASHERS = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="sha256")
# ... while these copy them into MLX arrays.
_READERS = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="tensor")
# safetensors dtype -> (NumPy dtype of its bytes, the MLX dtype to view them as, if not that)
_DTYPES: dict[str, tuple[type, mx.Dtype | None]] = {
    "BOOL": (np.bool_, None), "U8": (np.uint8, None), "I8": (np.int8, None),
    "U16": (np.uint16, None), "I16": (np.int16, None), "F16": (np.float16, None),
    "BF16": (np.uint16, mx.bfloat16), "U32": (np.uint32, None), "I32": (np.int32, None),
    "F32": (np.float32, None), "U64": (np.uint64, None), "I64": (np.int64, None),
}  # fmt: skip


class ModelIdentity(BaseModel):
    """What a session was computed under; a file loads only where all of it matches."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    dtype: str
    # Activation steering changes every hidden state; None while steering is off.
    steering: str | None = None
    # How attention K/V are stored (--kv-bits); None: full precision (and files
    # written before the setting existed).
    kv_quantization: KVQuantization | None = None

    @classmethod
    def of(
        cls,
        manifest: Manifest,
        dtype: mx.Dtype,
        steering: str | None,
        kv_quantization: KVQuantization | None = None,
    ) -> ModelIdentity:
        """The identity of a runner: its manifest canonically serialised and hashed
        (every weight file's sha256 is in it, so other weights hash differently)."""
        return cls(
            family=manifest.family,
            manifest_sha256=manifest_digest(manifest),
            dtype=str(dtype).removeprefix("mlx.core."),
            steering=steering,
            kv_quantization=kv_quantization,
        )


class SessionMeta(BaseModel):
    """The metadata of a session file (validated on every read)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["turbospark-session"] = "turbospark-session"
    # 1: one sha256 stream over every byte; 2: a sha256 of each tensor's bytes (see above).
    version: Literal[1, 2] = VERSION
    model: ModelIdentity
    tokens: list[int]
    # A vision map was active: placeholder ids cannot prove a match. Such sessions
    # are never written today (nothing could find them); the field keeps the format honest.
    tainted: bool = False
    components: list[str]
    checkpoints: list[int] = Field(description="positions of the prompt-boundary checkpoints")
    content_sha256: str = Field(default="", description="sha256 of everything else in the file")


class RejectReason(StrEnum):
    UNREADABLE = "unreadable"  # not a safetensors file, or truncated
    MALFORMED = "malformed"  # safetensors, but the metadata is not a session's
    CHECKSUM = "checksum"  # the content does not hash to the recorded sha256
    FOREIGN = "foreign"  # built under another model, dtype or steering
    KV_QUANTIZATION_DIFFERS = "kv_quantization_differs"  # K/V stored under another --kv-bits


class SessionFileError(TurbosparkError):
    """A session file that must not be loaded; ``reason`` says why."""

    def __init__(self, path: Path, reason: RejectReason, message: str) -> None:
        super().__init__(f"{path.name}: {message}")
        self.path = path
        self.reason = reason


def write_session(
    path: Path, snapshot: SessionSnapshot, model: ModelIdentity, components: list[str]
) -> int:
    """Write *snapshot* atomically to *path*; returns the file's size in bytes."""
    arrays = _flatten(snapshot, components)
    meta = SessionMeta(
        model=model,
        tokens=snapshot.tokens,
        tainted=snapshot.tainted,
        components=components,
        checkpoints=[c.position for c in snapshot.checkpoints],
    )
    buffers = {name: memoryview(value) for name, value in arrays.items()}
    digest = _content_sha256(meta, _shapes(arrays), _hash_tensors(meta, buffers))
    meta = meta.model_copy(update={"content_sha256": digest})
    # mx.save_safetensors appends the suffix to any other name, so the temp name keeps it.
    temp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        mx.save_safetensors(str(temp), arrays, metadata={META_KEY: meta.model_dump_json()})
        with temp.open("rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path.stat().st_size


def fsync_dir(directory: Path) -> None:
    """Make a rename (or unlink) in *directory* durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(path: Path) -> SessionMeta:
    """The metadata alone, from the safetensors header (the tensors are not read)."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                raise ValueError(f"the file is {len(raw)} bytes, shorter than a safetensors header")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise ValueError(f"a header of {length} bytes is not a session's")
            header = handle.read(length)
            if len(header) < length:
                raise ValueError(
                    f"the header is {length} bytes but the file ends after {len(header)}"
                )
        text = json.loads(header).get("__metadata__", {}).get(META_KEY)
    except (OSError, ValueError, UnicodeDecodeError, AttributeError) as exc:
        raise SessionFileError(
            path, RejectReason.UNREADABLE, f"not a readable safetensors file ({exc})"
        ) from exc
    if not isinstance(text, str):
        raise SessionFileError(
            path, RejectReason.MALFORMED, f"no '{META_KEY}' metadata: not a turbospark session"
        )
    try:
        return SessionMeta.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "metadata"
        raise SessionFileError(
            path, RejectReason.MALFORMED, f"bad session metadata ({where}: {first['msg']})"
        ) from exc


def check_model(path: Path, meta: SessionMeta, model: ModelIdentity) -> None:
    """Refuse a file built under another model, naming the first difference."""
    if meta.model == model:
        return
    theirs_kv, ours_kv = meta.model.kv_quantization, model.kv_quantization
    if meta.model.model_copy(update={"kv_quantization": ours_kv}) == model:
        flags = (
            "no --kv-bits"
            if theirs_kv is None
            else f"--kv-bits {theirs_kv.bits} --kv-group-size {theirs_kv.group_size}"
        )
        raise SessionFileError(
            path,
            RejectReason.KV_QUANTIZATION_DIFFERS,
            f"kv_quantization: its K/V are stored {describe_kv(theirs_kv)}, this runner's "
            f"{describe_kv(ours_kv)}; K/V of two settings are never mixed, so serve it with "
            f"{flags} to reuse it",
        )
    for field in ModelIdentity.model_fields:
        theirs, ours = getattr(meta.model, field), getattr(model, field)
        if theirs != ours:
            raise SessionFileError(
                path,
                RejectReason.FOREIGN,
                f"built under {field} {str(theirs)[:16]!r}, this runner has {str(ours)[:16]!r}; "
                "a session is never loaded into a different model",
            )


def read_session(path: Path, model: ModelIdentity) -> tuple[SessionMeta, SessionSnapshot]:
    """Read, verify (model identity, then sha256) and rebuild a session snapshot.

    The tensors hash from a memory map of the file (the page cache, no copy) in
    threads while other threads copy them from the same map into MLX arrays, so
    verifying costs little more than loading; nothing is returned unverified.
    """
    meta = read_meta(path)
    check_model(path, meta, model)
    try:
        with path.open("rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise SessionFileError(path, RejectReason.UNREADABLE, f"cannot be read ({exc})") from exc
    header, views = _tensor_views(path, memoryview(mapped))
    if header.get("__metadata__", {}).get(META_KEY) != meta.model_dump_json():
        raise SessionFileError(path, RejectReason.UNREADABLE, "the file changed while it was read")
    hashing = _hash_tensors(meta, views)
    try:
        arrays = _arrays(header, views)
        digest = _content_sha256(meta, _shapes(arrays), hashing)
    except (RuntimeError, ValueError, OSError) as exc:
        raise SessionFileError(path, RejectReason.UNREADABLE, f"cannot be read ({exc})") from exc
    finally:
        for future in hashing.values():  # a refused file: the queued hashes are moot
            if isinstance(future, Future):
                future.cancel()
    if digest != meta.content_sha256:
        raise SessionFileError(
            path,
            RejectReason.CHECKSUM,
            f"content hashes to {digest[:12]}…, the file records {meta.content_sha256[:12]}…: "
            "the file is corrupt",
        )
    try:
        return meta, _unflatten(meta, arrays)
    except (KeyError, ValueError) as exc:
        raise SessionFileError(
            path, RejectReason.MALFORMED, f"inconsistent tensors ({exc})"
        ) from exc


def _tensor_views(path: Path, raw: memoryview) -> tuple[dict, dict[str, memoryview]]:
    """The safetensors header of *raw* and each tensor's bytes (a view, no copy);
    a torn or inconsistent file is unreadable."""

    def unreadable(why: str) -> SessionFileError:
        return SessionFileError(path, RejectReason.UNREADABLE, f"cannot be read ({why})")

    if len(raw) < 8:
        raise unreadable("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", raw[:8])
    base = 8 + length
    try:
        header = json.loads(bytes(raw[8:base]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise unreadable(f"the header is not JSON: {exc}") from exc
    data = raw[base:]
    views: dict[str, memoryview] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(offset) for offset in info["data_offsets"])
            size = _ITEMSIZE[info["dtype"]] * math.prod(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise unreadable(f"tensor {name!r} has a bad header entry: {exc!r}") from exc
        if not 0 <= begin <= end <= len(data):
            raise unreadable(f"tensor {name!r} ends at byte {end}, the data ends at {len(data)}")
        if end - begin != size:
            raise unreadable(f"tensor {name!r} holds {end - begin} bytes, its shape {size}")
        views[name] = data[begin:end]
    return header, views


def _arrays(header: dict, views: Mapping[str, memoryview]) -> dict[str, mx.array]:
    """Every tensor as an MLX array, copied out of the map in threads (the copies
    release the GIL): on an H200 this reads a 268 MB file 1.4x faster than
    ``mx.load``, whose one-tensor-at-a-time reads were most of a reload."""

    def copy(name: str) -> mx.array:  # no lazy op here: MLX streams belong to their thread
        wire = _DTYPES[header[name]["dtype"]][0]
        return mx.array(np.frombuffer(views[name], dtype=wire).reshape(header[name]["shape"]))

    try:
        built = dict(zip(views, _READERS.map(copy, views), strict=True))
    except KeyError as exc:
        raise ValueError(f"a tensor of an unsupported dtype ({exc})") from exc
    for name, array in built.items():
        dtype = _DTYPES[header[name]["dtype"]][1]
        if dtype is not None:
            built[name] = array.view(dtype)
    mx.eval(list(built.values()))
    return built


def _flatten(snapshot: SessionSnapshot, components: list[str]) -> dict[str, mx.array]:
    """One flat name -> array mapping, contiguous (what is hashed is what is written)."""
    arrays = {
        f"state/{name}/{key}": value
        for name in components
        for key, value in snapshot.arrays[name].items()
    }
    for i, checkpoint in enumerate(snapshot.checkpoints):
        for name, snap in checkpoint.snapshots.items():
            arrays.update({f"checkpoint/{i}/{name}/{key}": value for key, value in snap.items()})
    arrays = {name: mx.contiguous(value) for name, value in arrays.items()}
    mx.eval(list(arrays.values()))
    return arrays


def _unflatten(meta: SessionMeta, arrays: dict[str, mx.array]) -> SessionSnapshot:
    state: dict[str, dict[str, mx.array]] = {name: {} for name in meta.components}
    held: list[dict[str, dict[str, mx.array]]] = [{} for _ in meta.checkpoints]
    for name, value in arrays.items():
        kind, rest = name.split("/", 1)
        if kind == "state":
            component, key = rest.split("/", 1)
            state[component][key] = value
        elif kind == "checkpoint":
            index, component, key = rest.split("/", 2)
            held[int(index)].setdefault(component, {})[key] = value
        else:
            raise ValueError(f"unexpected tensor {name!r}")
    return SessionSnapshot(
        tokens=list(meta.tokens),
        tainted=meta.tainted,
        arrays=state,
        checkpoints=tuple(
            Checkpoint(position, snaps)
            for position, snaps in zip(meta.checkpoints, held, strict=True)
        ),
    )


def _shapes(arrays: Mapping[str, mx.array]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (str(value.dtype), tuple(value.shape)) for name, value in arrays.items()}


def _hash_tensors(
    meta: SessionMeta, buffers: Mapping[str, memoryview]
) -> dict[str, Future[bytes]] | dict[str, memoryview]:
    """Start hashing each tensor's bytes in the thread pool (version 2); a version 1
    file is hashed as one stream later, so its buffers are passed through."""
    if meta.version == 1:
        return dict(buffers)
    return {name: _HASHERS.submit(_sha256, view) for name, view in buffers.items()}


def _sha256(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


def _content_sha256(
    meta: SessionMeta,
    shapes: Mapping[str, tuple[str, tuple[int, ...]]],
    tensors: Mapping[str, Future[bytes]] | Mapping[str, memoryview],
) -> str:
    """sha256 of the metadata (less this field) and every tensor in name order:
    its name, dtype, shape and then (version 2) its bytes' sha256 or (version 1)
    its bytes."""
    digest = hashlib.sha256(
        meta.model_copy(update={"content_sha256": ""}).model_dump_json().encode()
    )
    for name in sorted(tensors):
        dtype, shape = shapes[name]
        digest.update(f"\0{name}\0{dtype}\0{shape}\0".encode())
        part = tensors[name]
        digest.update(part.result() if isinstance(part, Future) else part)
    return digest.hexdigest()
