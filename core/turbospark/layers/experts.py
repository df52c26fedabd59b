"""The base of a family's routed-expert block: resident experts or a slot cache.

A family subclasses :class:`ExpertLayer`, names its stacked ``(E, out, in)``
projections as the checkpoint does (after ``sanitize``), and computes its
experts inside :meth:`ExpertLayer.routed`; the same code then runs with every
expert resident (``ExpertCacheSlots.all()``) or with a bounded cache streamed
from the install (:mod:`turbospark.policies.expert_cache`), with identical results.

A quantized checkpoint stores each table packed (mlx-lm's ``SwitchLinear``
layout): the words beside ``<name>_scales`` (and ``<name>_biases``), one per
group of inputs, for every expert. ``fn`` then receives a
:class:`PackedExperts` for that projection and :func:`gather_experts` runs
``mx.gather_qmm`` over it as mlx-lm's ``QuantizedSwitchLinear`` does, so a
family's ``fn`` is the same code for float and packed tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from turbospark.errors import InstallError
from turbospark.layers.packing import QuantSpec, spec_of

if TYPE_CHECKING:
    from turbospark.contract.protocols import ExpertSlots


class PackedExperts(NamedTuple):
    """One projection's expert tables, quantized: ``weight`` ``(S, out, in * bits / 32)``
    uint32 words, ``scales`` (and affine ``biases``) ``(S, out, in / group_size)``."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    spec: QuantSpec


# One projection's tables as ``fn`` receives them: float ``(S, out, in)`` or packed.
ExpertTable = mx.array | PackedExperts
# (tables: projection name -> table, indices (N, k) into S) -> per-choice outputs (N, k, ...)
ExpertFn = Callable[[dict[str, ExpertTable], mx.array], mx.array]


def gather_experts(x: mx.array, table: ExpertTable, indices: mx.array) -> mx.array:
    """``x @ table[indices].T`` for each (token, choice): ``mx.gather_mm`` over a
    float table, ``mx.gather_qmm`` over a packed one (mlx-lm's ``SwitchLinear``
    and ``QuantizedSwitchLinear``). *x* ``(..., 1, in)`` broadcasts against
    *indices*; the result is ``(..., 1, out)``."""
    if isinstance(table, PackedExperts):
        spec = table.spec
        return mx.gather_qmm(
            x,
            table.weight,
            table.scales,
            table.biases,
            rhs_indices=indices,
            transpose=True,
            group_size=spec.group_size,
            bits=spec.bits,
            mode=spec.mode,
        )
    return mx.gather_mm(x, table.swapaxes(-1, -2), rhs_indices=indices)


class ExpertLayer(nn.Module):
    """Stacked expert matrices ``projection -> (num_experts, out, in)``."""

    def __init__(self, num_experts: int, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        # Plain attributes, not tree entries: MLX would keep a tuple or dict among the children.
        object.__setattr__(self, "projections", tuple(shapes))
        object.__setattr__(self, "shapes", dict(shapes))
        object.__setattr__(self, "_specs", {})  # projection -> packing, once known
        for name, shape in shapes.items():
            setattr(self, name, mx.zeros((num_experts, *shape)))
        self._cache: ExpertSlots | None = None

    def stream_from(self, cache: ExpertSlots) -> None:
        """Drop the resident matrices; read experts through *cache* from now on."""
        for name in self.projections:
            del self[name]
        self._cache = cache

    def quantize_from(self, path: str, weights: dict[str, mx.array]) -> dict[str, QuantSpec]:
        """Make room for the packed tables *weights* hold (``<path>.<name>`` words
        beside ``<path>.<name>_scales`` and ``_biases``), with the packing their
        shapes imply; called by the loader before the weights load. A streamed
        layer holds no tables: its slots are packed as the install is."""
        found: dict[str, QuantSpec] = {}
        for name in self.projections:
            key = f"{path}.{name}"
            if self._cache is not None or f"{key}_scales" not in weights:
                continue
            packed, scales = weights[key], weights[f"{key}_scales"]
            biases = weights.get(f"{key}_biases")
            spec = spec_of(key, self.shapes[name][1], packed, scales, biases is not None)
            rows = (self[name].shape[0], self.shapes[name][0])  # (experts, out)
            if any(t.ndim != 3 or tuple(t.shape[:2]) != rows for t in (packed, scales)):
                raise InstallError(
                    f"{key} is stored packed as {tuple(packed.shape)} with scales "
                    f"{tuple(scales.shape)}, but {rows[0]} experts of {rows[1]} rows are "
                    "expected; the checkpoint does not match its config.json"
                )
            self[name] = mx.zeros(packed.shape, dtype=mx.uint32)
            self[f"{name}_scales"] = mx.zeros(scales.shape, dtype=scales.dtype)
            if biases is not None:
                self[f"{name}_biases"] = mx.zeros(biases.shape, dtype=biases.dtype)
            self._specs[name] = found[key] = spec
        return found

    def quantized_specs(self, path: str) -> dict[str, QuantSpec]:
        """How each packed projection is packed (for ``quantization_of``)."""
        flat = self._cache.tables if self._cache is not None else self._flat()
        tables = self._view(flat)
        return {
            f"{path}.{name}": table.spec
            for name, table in tables.items()
            if isinstance(table, PackedExperts)
        }

    def tables(self) -> dict[str, ExpertTable]:
        """The resident tables, each projection's as ``fn`` receives it."""
        return self._view(self._flat())

    @property
    def nbytes(self) -> int:
        """Bytes of the resident tables (packed words, scales and biases included)."""
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    def _flat(self) -> dict[str, mx.array]:
        return {name: value for name, value in self.items() if isinstance(value, mx.array)}

    def _view(self, flat: dict[str, mx.array]) -> dict[str, ExpertTable]:
        """Each projection's table as ``fn`` receives it, from the flat tensors
        (``name``, ``name_scales``, ``name_biases``) a layer or a slot cache holds."""
        out: dict[str, ExpertTable] = {}
        for name in self.projections:
            if f"{name}_scales" not in flat:
                out[name] = flat[name]
                continue
            biases = flat.get(f"{name}_biases")
            spec = self._specs.get(name)
            if spec is None:
                spec = spec_of(
                    name,
                    self.shapes[name][1],
                    flat[name],
                    flat[f"{name}_scales"],
                    biases is not None,
                )
                self._specs[name] = spec
            out[name] = PackedExperts(flat[name], flat[f"{name}_scales"], biases, spec)
        return out

    def routed(self, chosen: mx.array, fn: ExpertFn, overlap: Sequence[mx.array] = ()) -> mx.array:
        """``fn(tables, indices)`` for the experts *chosen* ``(N, k)`` routes to.

        Resident: one call over the full tables. Streamed: the router's choice is
        evaluated, missing experts are read into slots, and ``fn`` runs over slot
        indices; a step routed to more experts than there are slots runs once
        per group, each (token, choice) output taken from the group holding its
        expert, so every output is computed exactly as in the resident case.

        *overlap*: work of the same layer that does not need the experts (a
        dense branch beside them); when streaming it is started with the router,
        so it computes while the missing experts are read."""
        if self._cache is None:
            return fn(self.tables(), chosen)
        mx.async_eval(chosen, *overlap)
        out: mx.array | None = None
        for group in self._cache.groups(chosen):
            y = fn(self._view(group.tables), group.indices)
            if group.mask is None:
                return y
            mask = group.mask.reshape(*group.mask.shape, *([1] * (y.ndim - 2)))
            out = y if out is None else mx.where(mask, y, out)
            mx.eval(out)  # before the next group's experts are written into the slots
            del group, y  # so those writes can reuse the slot tables in place
        assert out is not None
        return out
