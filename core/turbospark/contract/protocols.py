"""What the runtime hands a family's hooks, as protocols: the contract names them, the runtime implements them.

A family codes against these (``turbospark.sdk`` exports them); the runtime's
classes (the steering policy's joins, the MTP drafter, the expert cache) satisfy
them without the contract importing any of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

    from turbospark.state.kv import KVComponent


class LayerHook(Protocol):
    """What a steerable family calls at each layer's output: ``h`` is ``(B, L, hidden)``."""

    def __call__(self, layer: int, h: mx.array) -> mx.array: ...


# A family's tail up to its layer's last join: ``parts(*args) -> (h, update)``,
# a module-level function over arrays (it keys compiled functions).
Parts = Callable[..., tuple["mx.array", "mx.array"]]


class Join(Protocol):
    """Layer *i*'s last residual join and the steering after it, handed to a
    family by :func:`turbospark.sdk.joiner`."""

    def __call__(self, h: mx.array, update: mx.array, scale: mx.array | None) -> mx.array:
        """``steer(i, (h + update) * scale)`` (no scale: ``h + update``)."""
        ...

    def fold(
        self, parts: Parts, args: tuple[Any, ...], scale: mx.array | None, compiled: bool
    ) -> mx.array:
        """``self(*parts(*args), scale)``. With *compiled* (a step the family
        compiles, :func:`~turbospark.layers.fused.runs_compiled`), a steering
        policy traces *parts* and its steering as one compiled function, so the
        steered layer costs one compiled call as the unsteered one does; any
        other hook gets *parts* compiled alone, then the join and the hook."""
        ...


class MultiTokenHead(Protocol):
    """What a family's MTP head offers (``turbospark_mtp_head``)."""

    def new_cache(self, start: int) -> KVComponent:
        """The head's empty K/V, its first entry to be at position *start*."""

    def step(self, tokens: mx.array, hidden: mx.array, cache: KVComponent) -> mx.array:
        """Entries at ``cache.position ..`` from ``tokens`` ``(L,)`` (entry ``i``'s
        token is the one after its hidden state's position) and the hidden states
        ``(L, hidden)``; returns the head's outputs ``(L, hidden)``. Advances *cache*."""

    def logits(self, hidden: mx.array) -> mx.array:
        """float32 logits ``(L, vocab)`` for the head's outputs."""


class ExpertGroup(Protocol):
    """Experts read into slots for one pass of a routed layer."""

    tables: dict[str, mx.array]  # projection -> (slots, out, in); packed: and its _scales, _biases
    indices: mx.array  # (N, k) slot of each (token, choice)
    mask: mx.array | None  # (N, k): the choices this group computes; None: all of them


class ExpertSlots(Protocol):
    """One routed layer's bounded cache of expert slots, as an ``ExpertLayer`` reads it."""

    tables: dict[str, mx.array]  # the slot tables as they stand, named as in ExpertGroup

    def groups(self, chosen: mx.array) -> Iterable[ExpertGroup]:
        """The groups covering every expert *chosen* ``(N, k)`` routes to, each read into slots."""
        ...


class ExpertStreams(Protocol):
    """What ``turbospark_load_model`` receives as *experts* when experts are streamed."""

    def attach(self, model: nn.Module) -> None:
        """Point every ``ExpertLayer`` of *model* at its layer's :class:`ExpertSlots`."""
        ...
