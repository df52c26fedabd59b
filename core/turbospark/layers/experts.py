"""The base of a family's routed-expert block: resident experts or a slot cache.

A family subclasses :class:`ExpertLayer`, names its stacked ``(E, out, in)``
projections as the checkpoint does (after ``sanitize``), and computes its
experts inside :meth:`ExpertLayer.routed`; the same code then runs with every
expert resident (``ExpertCacheSlots.all()``) or with a bounded cache streamed
from the install (:mod:`turbospark.policies.expert_cache`), with identical results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from turbospark.contract.protocols import ExpertSlots

# (tables: projection name -> (S, out, in), indices (N, k) into S) -> per-choice outputs (N, k, ...)
ExpertFn = Callable[[dict[str, mx.array], mx.array], mx.array]


class ExpertLayer(nn.Module):
    """Stacked expert matrices ``projection -> (num_experts, out, in)``."""

    def __init__(self, num_experts: int, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        # A plain attribute, not a tree entry: MLX would keep a tuple among the children.
        object.__setattr__(self, "projections", tuple(shapes))
        for name, shape in shapes.items():
            setattr(self, name, mx.zeros((num_experts, *shape)))
        self._cache: ExpertSlots | None = None

    def stream_from(self, cache: ExpertSlots) -> None:
        """Drop the resident matrices; read experts through *cache* from now on."""
        for name in self.projections:
            del self[name]
        self._cache = cache

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
            return fn({name: self[name] for name in self.projections}, chosen)
        mx.async_eval(chosen, *overlap)
        out: mx.array | None = None
        for group in self._cache.groups(chosen):
            y = fn(group.tables, group.indices)
            if group.mask is None:
                return y
            mask = group.mask.reshape(*group.mask.shape, *([1] * (y.ndim - 2)))
            out = y if out is None else mx.where(mask, y, out)
            mx.eval(out)  # before the next group's experts are written into the slots
            del group, y  # so those writes can reuse the slot tables in place
        assert out is not None
        return out
