"""Routed experts streamed from the install into a bounded cache of slots.

With ``ExpertCacheSlots.fixed(n)`` below ``num_experts`` the runner loads no
expert tensor with the other weights. Each MoE layer instead holds ``n`` slots
(one stacked ``(n, out, in)`` array per projection) and a table from expert to
slot. When a step's router has chosen, the experts it chose that are not
resident are read from the install's safetensors (memory-mapped byte ranges of
exactly that expert's rows: never a whole tensor) into slots; the layer then
runs ``gather_mm`` over slot indices, which computes each token's experts from
the same numbers as the resident path, so logits are identical.

A quantized install's experts stream packed: a slot holds the expert's packed
words and its scales (and biases) as the install stores them, read from the
same rows of the three tensors, so a slot of a 4-bit install costs about a
quarter of a bfloat16 one and ``ExpertCacheSlots.auto()`` fits that many more.

MLX is lazy: the choice is only known once the router's top-k is evaluated,
so a streaming layer synchronises once per step (``ExpertLayer.routed``). The
dense MLP branch and the attention before it are already queued by then.

Eviction is least frequently used (tokens routed to the expert since it was
loaded), ties broken by least recently used; experts the current step routes
to are pinned. A step whose experts do not fit (a prefill chunk, or a batch of
rows, routing to more than ``n`` distinct experts) runs in groups of at most
``n`` experts, resident ones first, each group's outputs kept for the tokens
routed into it; so the slots never grow. A read that fails (the install
changed under the server) raises before any slot or table changes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, ConfigDict

from turbospark.contract.hookspecs import ExpertProjection, ExpertSlice, MoESpec
from turbospark.errors import InstallError, InvalidInput
from turbospark.layers.experts import ExpertLayer
from turbospark.layers.packing import QuantSpec, spec_from_shapes
from turbospark.policies import ExpertCacheSlots

# safetensors dtype -> (numpy dtype holding the raw bytes, MLX dtype they are)
_DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "F32": (np.dtype("<f4"), mx.float32),
    "F16": (np.dtype("<f2"), mx.float16),
    "BF16": (np.dtype("<u2"), mx.bfloat16),  # numpy has no bfloat16: read bits, view in MLX
    "U32": (np.dtype("<u4"), mx.uint32),  # packed words of a quantized table
    "U8": (np.dtype("u1"), mx.uint8),  # the scales of the microscaling modes
}


@dataclass(frozen=True)
class TensorEntry:
    """A tensor's place in a safetensors file, from its header alone."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file


def read_headers(files: list[Path]) -> dict[str, TensorEntry]:
    """Every tensor's dtype, shape and byte offset, reading only the headers
    (an 8-byte little-endian length, then that much JSON)."""
    entries: dict[str, TensorEntry] = {}
    for file in files:
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, _ = info["data_offsets"]
            entries[name] = TensorEntry(
                file, info["dtype"], tuple(info["shape"]), 8 + length + begin
            )
    return entries


@dataclass(frozen=True)
class ResolvedSlice:
    """Where one projection of one expert starts and how big it is; a packed
    projection has its scales (and biases) beside it, in the same rows."""

    entry: TensorEntry
    row_start: int
    shape: tuple[int, int]  # (out, in)
    spec: QuantSpec | None = None
    scales: TensorEntry | None = None
    biases: TensorEntry | None = None

    def parts(self, name: str) -> dict[str, TensorEntry]:
        """The slot tables this projection fills, by name (``name``, ``name_scales``...)."""
        extra = {"scales": self.scales, "biases": self.biases}
        return {name: self.entry} | {f"{name}_{k}": e for k, e in extra.items() if e is not None}

    def byte_range(self, expert: int, entry: TensorEntry | None = None) -> tuple[int, int]:
        """``tensor[expert, row_start:row_start+out, :]`` is one contiguous run
        (of the weight, or of *entry*: its scales or biases)."""
        entry = entry or self.entry
        rows, cols = entry.shape[1:]
        itemsize = _DTYPES[entry.dtype][0].itemsize
        start = entry.offset + ((expert * rows + self.row_start) * cols) * itemsize
        return start, self.shape[0] * cols * itemsize

    def slot_bytes(self, dtype: mx.Dtype) -> int:
        """One expert's bytes of this projection in a slot: packed words and
        uint8 scales as stored, floating values in the compute *dtype*."""
        entries = self.parts("").values()
        return sum(self.shape[0] * e.shape[2] * _slot_dtype(e, dtype).size for e in entries)


def _slot_dtype(entry: TensorEntry, dtype: mx.Dtype) -> mx.Dtype:
    """A slot keeps integers (packed words, uint8 scales) as stored; floats in *dtype*."""
    stored = _DTYPES[entry.dtype][1]
    return stored if stored in (mx.uint32, mx.uint8) else dtype


def resolve(
    spec: MoESpec, entries: dict[str, TensorEntry], *, check_dtype: bool
) -> dict[str, dict[str, ResolvedSlice]]:
    """The install's tensor for every projection of every expert layer, checked
    against the declared shapes; refuses a missing or mis-shaped one by name
    (and, with *check_dtype*, one this module cannot read)."""
    resolved: dict[str, dict[str, ResolvedSlice]] = {}
    for path, projections in spec.layers.items():
        resolved[path] = {
            name: _resolve_one(spec.num_experts, path, name, proj, entries, check_dtype)
            for name, proj in projections.items()
        }
    return resolved


def _resolve_one(
    experts: int,
    path: str,
    name: str,
    proj: ExpertProjection,
    entries: dict[str, TensorEntry],
    check_dtype: bool,
) -> ResolvedSlice:
    source = next((s for s in proj.sources if s.tensor in entries), None)
    if source is None:
        tried = " or ".join(s.tensor for s in proj.sources)
        raise InstallError(
            f"expert tensor {tried} is missing from the install's safetensors; "
            "the checkpoint does not match its config.json (re-run the import)"
        )
    entry = entries[source.tensor]
    out, cols = proj.shape
    base = source.tensor.removesuffix(".weight")
    scales, biases = entries.get(f"{base}.scales"), entries.get(f"{base}.biases")
    spec = None
    if scales is not None:  # packed: its width is cols * bits / 32 words
        spec = spec_from_shapes(
            source.tensor,
            cols,
            (entry.shape, entry.dtype == "U32"),
            (scales.shape, scales.dtype == "U8"),
            biases is not None,
        )
        width = spec.packed_width(cols)
    else:
        width = cols
    start, stop = source.rows or (0, entry.shape[1] if len(entry.shape) == 3 else -1)
    if (
        len(entry.shape) != 3
        or entry.shape[0] != experts
        or entry.shape[2] != width
        or (stop - start != out or stop > entry.shape[1])
        or any(e is not None and e.shape[:2] != entry.shape[:2] for e in (scales, biases))
    ):
        raise InstallError(
            f"expert tensor {source.tensor} has shape {entry.shape}, but {path}.{name} needs "
            f"({experts}, {out if source.rows is None else 'rows ' + str(source.rows)}, {width}"
            f"{'' if spec is None else ' packed words'}); the checkpoint does not match its "
            "config.json"
        )
    for e in (entry, scales, biases):
        if check_dtype and e is not None and e.dtype not in _DTYPES:
            raise InstallError(
                f"expert tensor {source.tensor} is {e.dtype}; streamed experts read "
                f"{', '.join(_DTYPES)} only: use ExpertCacheSlots.all() or re-import as bfloat16"
            )
    return ResolvedSlice(entry, start, (out, cols), spec, scales, biases)


def check_policy(policy: ExpertCacheSlots, spec: MoESpec | None, family: str) -> None:
    """Refuse a policy the model cannot take, before any weight is read."""
    if policy.mode == "all":
        return
    if spec is None:
        raise InvalidInput(
            f"ExpertCacheSlots {policy} asks to stream experts, but family '{family}' declares no "
            "MoE experts for this install; use ExpertCacheSlots.all() (--expert-cache-slots all)"
        )
    if policy.slots is not None and policy.slots < spec.top_k:
        raise InvalidInput(
            f"ExpertCacheSlots.fixed({policy.slots}) holds fewer experts than a token routes to "
            f"(top_k_experts={spec.top_k}); use at least {spec.top_k}"
        )


def available_memory() -> int:
    """MLX's recommended working set on a GPU; free physical memory otherwise."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_slots(spec: MoESpec, expert_bytes: int, other_bytes: int, available: int) -> int:
    """Half of *available*, less the weights that are not experts, over the MoE
    layers' experts (*expert_bytes*: one expert of one layer, every projection);
    clamped to ``top_k .. num_experts``."""
    budget = available // 2 - other_bytes
    per_layer = budget // max(1, expert_bytes * len(spec.layers))
    return max(spec.top_k, min(spec.num_experts, per_layer))


class ExpertCacheStats(BaseModel):
    """``Runner.expert_cache_stats()``: counts since the runner opened.

    A hit or miss is one distinct expert a step of one layer routes to, found
    resident or read in. Under ``all()`` nothing is counted (every expert is
    resident; no step looks), and ``resident_bytes`` is every expert. Bytes are
    as held: a quantized expert's packed words, scales and biases."""

    model_config = ConfigDict(frozen=True)

    policy: str
    layers: int
    num_experts: int
    slots_per_layer: int
    hits: int
    misses: int
    bytes_read: int
    resident_bytes: int


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0


@dataclass
class Group:
    """Experts computed together: slot tables, slot index per (token, choice),
    and (when the step needs several groups) which choices this group serves."""

    tables: dict[str, mx.array]
    indices: mx.array
    mask: mx.array | None


@dataclass
class ExpertCache:
    """The slots of one MoE layer and the bookkeeping that decides what they hold."""

    path: str
    slices: dict[str, ResolvedSlice]
    num_experts: int
    num_slots: int
    dtype: mx.Dtype  # of floating values; packed words and uint8 scales stay as stored
    counters: Counters
    tables: dict[str, mx.array] = field(init=False)
    _expert_in: list[int | None] = field(init=False)  # slot -> expert
    _slot_of: dict[int, int] = field(init=False)  # expert -> slot
    _uses: dict[int, int] = field(init=False)  # expert -> tokens routed since loaded
    _last: dict[int, int] = field(init=False)  # expert -> step it was last used
    _step: int = 0

    def __post_init__(self) -> None:
        self.tables = {  # (n, out, in); packed: (n, out, words) and its (n, out, groups)
            table: mx.zeros(
                (self.num_slots, s.shape[0], entry.shape[2]), dtype=_slot_dtype(entry, self.dtype)
            )
            for name, s in self.slices.items()
            for table, entry in s.parts(name).items()
        }
        mx.eval(*self.tables.values())
        self._expert_in = [None] * self.num_slots
        self._slot_of, self._uses, self._last = {}, {}, {}

    @property
    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())

    @property
    def resident(self) -> dict[int, int]:
        """Expert -> slot, as it stands between steps."""
        return dict(self._slot_of)

    def groups(self, chosen: mx.array) -> Iterator[Group]:
        """Load what *chosen* ``(N, k)`` routes to and yield the groups to compute.

        Evaluates *chosen* (the one synchronisation streaming needs)."""
        routed = np.array(chosen)  # waits for the router
        experts, counts = np.unique(routed, return_counts=True)
        self._step += 1
        for e, c in zip(experts.tolist(), counts.tolist(), strict=True):
            self._uses[e] = self._uses.get(e, 0) + c
        hits = [e for e in experts.tolist() if e in self._slot_of]
        needed = hits + [e for e in experts.tolist() if e not in self._slot_of]
        batches = [needed[i : i + self.num_slots] for i in range(0, len(needed), self.num_slots)]
        for batch in batches:
            self._load(batch)
            remap = np.zeros(self.num_experts, dtype=np.int32)
            for e in batch:
                remap[e] = self._slot_of[e]
                self._last[e] = self._step
            indices = mx.array(remap[routed])
            mask = None if len(batches) == 1 else mx.array(np.isin(routed, batch))
            yield Group(dict(self.tables), indices, mask)

    def _load(self, batch: list[int]) -> None:
        """Make every expert of *batch* resident, evicting only experts outside it."""
        missing = [e for e in batch if e not in self._slot_of]
        self.counters.hits += len(batch) - len(missing)
        if not missing:
            return
        pinned = set(batch)
        free = [s for s, e in enumerate(self._expert_in) if e is None]
        victims = sorted(
            (e for e in self._slot_of if e not in pinned),
            key=lambda e: (self._uses.get(e, 0), self._last.get(e, 0)),
        )
        targets = free + [self._slot_of[e] for e in victims]
        targets = targets[: len(missing)]
        read = self._read(missing)  # may raise: nothing has changed yet
        for name, rows in read.items():
            table = self.tables[name]
            for slot, expert in zip(targets, rows, strict=True):
                # A slice update at a dynamic start: written in place (the table's only
                # reference is here), where a scatter costs ~10x as much on the CPU.
                update = expert.astype(table.dtype)[None]  # (out, in) -> (1, out, in)
                table = mx.slice_update(table, update, mx.array([slot]), axes=(0,))
            self.tables[name] = table
        mx.eval(*self.tables.values())
        for slot, expert in zip(targets, missing, strict=True):
            old = self._expert_in[slot]
            if old is not None:
                del self._slot_of[old]
                self._uses.pop(old, None)
            self._expert_in[slot] = expert
            self._slot_of[expert] = slot
            self._uses.setdefault(expert, 0)
        self.counters.misses += len(missing)

    def _read(self, experts: list[int]) -> dict[str, list[mx.array]]:
        """Each expert's rows of each projection, read through a memory map of
        the file: only those byte ranges are touched."""
        out: dict[str, list[mx.array]] = {name: [] for name in self.tables}
        maps: dict[Path, np.memmap] = {}
        try:
            for table, piece, entry in self._pieces():
                file = entry.file
                if file not in maps:
                    maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
                raw_dtype, mx_dtype = _DTYPES[entry.dtype]
                for expert in experts:
                    start, size = piece.byte_range(expert, entry)
                    if start + size > maps[file].size:
                        raise OSError(f"{file} is shorter than its header says (truncated)")
                    rows = np.frombuffer(maps[file][start : start + size].tobytes(), raw_dtype)
                    array = mx.array(rows.reshape(piece.shape[0], -1))  # (out, in)
                    out[table].append(array.view(mx_dtype) if raw_dtype.kind == "u" else array)
                    self.counters.bytes_read += size
        except (OSError, ValueError) as exc:
            raise InstallError(
                f"reading experts {experts} of {self.path} from the install failed ({exc}); "
                "the install changed under the runner: restore it or re-run the import"
            ) from exc
        finally:
            for mapped in maps.values():
                mapped._mmap.close()  # release the mapping now, not at garbage collection
        return out

    def _pieces(self) -> Iterator[tuple[str, ResolvedSlice, TensorEntry]]:
        """Every slot table with the projection and install tensor it is read from."""
        for name, piece in self.slices.items():
            for table, entry in piece.parts(name).items():
                yield table, piece, entry


class StreamedExperts:
    """Every MoE layer's cache: the :class:`~turbospark.contract.protocols.ExpertStreams` that ``turbospark_load_model`` receives."""

    def __init__(
        self,
        spec: MoESpec,
        slices: dict[str, dict[str, ResolvedSlice]],
        num_slots: int,
        dtype: mx.Dtype,
        policy: ExpertCacheSlots,
    ) -> None:
        self.spec, self.num_slots, self.policy = spec, num_slots, policy
        self.counters = Counters()
        self.caches = {
            path: ExpertCache(path, layer, spec.num_experts, num_slots, dtype, self.counters)
            for path, layer in slices.items()
        }

    @property
    def tensor_names(self) -> set[str]:
        """The install tensors the caches read (left out of the loaded weights)."""
        return {
            name
            for layer in self.spec.layers.values()
            for source in _sources(layer)
            for name in _with_packing(source.tensor)
        }

    def attach(self, model: object) -> None:
        """Point every :class:`~turbospark.layers.experts.ExpertLayer` of *model*
        at its cache (its stacked parameters go: the weights hold none)."""
        found = {path: m for path, m in model.named_modules() if isinstance(m, ExpertLayer)}
        if set(found) != set(self.caches):
            raise InstallError(
                f"the family declares expert layers {sorted(self.caches)[:3]} but its model has "
                f"{sorted(found)[:3]}; a family bug: turbospark_moe and the model disagree"
            )
        for path, module in found.items():
            module.stream_from(self.caches[path])

    def stats(self) -> ExpertCacheStats:
        return ExpertCacheStats(
            policy=str(self.policy),
            layers=len(self.caches),
            num_experts=self.spec.num_experts,
            slots_per_layer=self.num_slots,
            hits=self.counters.hits,
            misses=self.counters.misses,
            bytes_read=self.counters.bytes_read,
            resident_bytes=sum(c.resident_bytes for c in self.caches.values()),
        )


def plan_streams(
    root: Path,
    weight_files: list[str],
    spec: MoESpec | None,
    policy: ExpertCacheSlots,
    dtype: mx.Dtype,
) -> StreamedExperts | None:
    """The caches *policy* asks for, from the install's safetensors headers only
    (so a missing or mis-shaped expert tensor is refused before any weight is
    read); ``None`` when every expert stays resident."""
    if spec is None:
        return None
    try:
        entries = read_headers([root / name for name in weight_files])
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise InstallError(
            f"the safetensors headers of {root} cannot be read ({exc}); re-run the import"
        ) from exc
    streaming = policy.mode != "all"
    slices = resolve(spec, entries, check_dtype=streaming)
    if not streaming:
        return None
    slots = policy.slots or _auto(spec, slices, entries, dtype)
    if slots >= spec.num_experts:
        return None
    return StreamedExperts(spec, slices, slots, dtype, policy)


def _auto(
    spec: MoESpec,
    slices: dict[str, dict[str, ResolvedSlice]],
    entries: dict[str, TensorEntry],
    dtype: mx.Dtype,
) -> int:
    """:func:`auto_slots` for this install: one expert's bytes as a slot holds
    them (packed, or in the compute dtype), and every other tensor's bytes as stored."""
    layer = next(iter(slices.values()))
    one_expert = sum(p.slot_bytes(dtype) for p in layer.values())
    streamed = {
        name
        for layer in spec.layers.values()
        for source in _sources(layer)
        for name in _with_packing(source.tensor)
    }
    other = sum(
        math.prod(entry.shape) * _itemsize(entry.dtype)
        for name, entry in entries.items()
        if name not in streamed
    )
    return auto_slots(spec, one_expert, other, available_memory())


def _sources(layer: dict[str, ExpertProjection]) -> Iterator[ExpertSlice]:
    for projection in layer.values():
        yield from projection.sources


def _with_packing(tensor: str) -> tuple[str, ...]:
    """*tensor* and the scales and biases a packed one has beside it."""
    base = tensor.removesuffix(".weight")
    return (tensor, f"{base}.scales", f"{base}.biases")


def _itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (``BF16``, ``F8_E4M3``, ``BOOL``...)."""
    bits = re.search(r"\d+", dtype)
    return int(bits.group()) // 8 if bits else 1


def resident_stats(spec: MoESpec, model: object, policy: ExpertCacheSlots) -> ExpertCacheStats:
    """The stats of a model whose experts are all resident (nothing streamed)."""
    resident = sum(
        module.nbytes for _, module in model.named_modules() if isinstance(module, ExpertLayer)
    )
    return ExpertCacheStats(
        policy=str(policy),
        layers=len(spec.layers),
        num_experts=spec.num_experts,
        slots_per_layer=spec.num_experts,
        hits=0,
        misses=0,
        bytes_read=0,
        resident_bytes=resident,
    )
