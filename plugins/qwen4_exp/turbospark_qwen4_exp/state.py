"""The qwen4_exp session state: five components, and which of them may move.

===============  ==========================================  =========  ==========
component        holds                                       swappable  rewindable
===============  ==========================================  =========  ==========
kv               keys/values of every QSA layer               yes        yes
gdn              recurrent matrix + conv tail per DeltaNet    no         no
qsa              raw index keys + pooled block means          no         yes
ngram_context    the last ``ngram_n - 1`` token ids           no         no
ple_conv_tail    the last ``(kernel-1)*dilation`` PLE rows    no         no
===============  ==========================================  =========  ==========

Only ``kv`` is declared swappable: this experimental family has not proven
that parking the other four is lossless, so the runner refuses a session pool
by naming them and this file. ``ngram_context`` and ``ple_conv_tail`` keep a
fixed-size trailing window and drop what falls out of it, so (like the GDN
conv tail) they cannot go back; they are tiny, so the generation loop's
checkpoint of non-rewindable components covers them for free. ``qsa`` keeps
every raw index key, so it can truncate exactly. The three that cannot go
back are traceable: a speculative verify pass keeps their state after every
token, so rejected drafts are dropped without a second forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from turbospark.hookspecs import ComponentSpec
from turbospark.layers.gated_delta import GDNComponent
from turbospark.state import KVComponent, LayeredComponent, Snapshot, State, refuse_rewind

if TYPE_CHECKING:
    from turbospark_qwen4_exp.model import Qwen4ExpConfig

COMPONENTS = [
    ComponentSpec(
        name="kv",
        description="keys/values of the query-sparse attention layers",
        swappable=True,
        rewindable=True,
        persistable=True,
    ),
    ComponentSpec(
        name="gdn",
        description="per gated-DeltaNet layer: float32 recurrent matrix and conv tail",
        swappable=False,
        rewindable=False,
        persistable=True,
        traceable=True,
    ),
    ComponentSpec(
        name="qsa",
        description="per QSA layer: raw index keys of every token and pooled block means",
        swappable=False,
        rewindable=True,
        persistable=True,
    ),
    ComponentSpec(
        name="ngram_context",
        description="the last ngram_n - 1 token ids (EOS before the first token)",
        swappable=False,
        rewindable=False,
        persistable=True,
        traceable=True,
    ),
    ComponentSpec(
        name="ple_conv_tail",
        description="the last (kernel - 1) * dilation n-gram embedding rows of the PLE conv",
        swappable=False,
        rewindable=False,
        persistable=True,
        traceable=True,
    ),
]


class LayerIndex:
    """The indexer cache of one QSA layer.

    ``keys`` holds the raw ``(tokens, index_head_dim)`` index key of every past
    token; ``pooled`` holds ``(blocks, index_head_dim)`` means of the keys of
    each *complete* block of ``block_size`` tokens. Both grow in ``step``-row
    chunks and are written in place, as :class:`~turbospark.state.LayerKV`
    does, so decode never re-copies the history.
    """

    step = 256

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.keys: mx.array | None = None
        self.pooled: mx.array | None = None
        self.fill = 0

    @property
    def blocks(self) -> int:
        return self.fill // self.block_size

    def reset(self) -> None:
        self.keys = self.pooled = None
        self.fill = 0

    @property
    def max_safe_rewind(self) -> int:
        return self.fill  # every raw key is kept

    def rewind(self, n: int) -> None:
        # Pooled rows of blocks that are no longer complete are simply ignored
        # (``blocks`` shrinks with ``fill``) and overwritten when they complete again.
        self.fill -= n

    @staticmethod
    def _grown(buffer: mx.array | None, used: int, need: int, like: mx.array) -> mx.array:
        capacity = 0 if buffer is None else buffer.shape[0]
        if need <= capacity:
            return buffer
        grow = ((need - capacity + LayerIndex.step - 1) // LayerIndex.step) * LayerIndex.step
        extra = mx.zeros((grow, like.shape[1]), like.dtype)
        return extra if buffer is None else mx.concatenate([buffer[:used], extra], axis=0)

    def append(self, keys: mx.array) -> mx.array:
        """Append ``(L, index_head_dim)`` keys; return the pooled keys of every
        block complete after them, ``(blocks, index_head_dim)``."""
        length = keys.shape[0]
        old_blocks = self.blocks
        self.keys = self._grown(self.keys, self.fill, self.fill + length, keys)
        self.keys[self.fill : self.fill + length] = keys
        self.fill += length
        new_blocks = self.blocks
        if new_blocks > old_blocks:
            self.pooled = self._grown(self.pooled, old_blocks, new_blocks, keys)
            size = self.block_size
            rows = self.keys[old_blocks * size : new_blocks * size]
            # (new blocks * size, dim) -> (new blocks, size, dim): one mean per block
            rows = rows.reshape(new_blocks - old_blocks, size, rows.shape[1])
            self.pooled[old_blocks:new_blocks] = rows.mean(axis=1)
        if self.pooled is None:
            return mx.zeros((0, keys.shape[1]), keys.dtype)
        return self.pooled[:new_blocks]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.pooled) if a is not None]

    def snapshot(self, prefix: str) -> Snapshot:
        if self.keys is None:
            return {}
        snap = {f"{prefix}.keys": self.keys[: self.fill]}
        if self.pooled is not None:
            snap[f"{prefix}.pooled"] = self.pooled[: self.blocks]
        return snap

    def restore(self, snapshot: Snapshot, prefix: str) -> None:
        self.keys = snapshot.get(f"{prefix}.keys")
        self.pooled = snapshot.get(f"{prefix}.pooled")
        self.fill = 0 if self.keys is None else self.keys.shape[0]


class QSAComponent(LayeredComponent[LayerIndex]):
    """The query-sparse-attention indexer state of every QSA layer.

    Rewindable without limit: raw keys are kept for every token, and the
    pooled mean of a block that is still complete after a rewind is unchanged.
    """

    def __init__(self, num_layers: int, block_size: int):
        super().__init__("qsa", [LayerIndex(block_size) for _ in range(num_layers)])


class StreamTail:
    """The last ``rows`` rows of a stream (token ids, or embedding rows).

    A causal operator over a short window (an n-gram hash, a dilated conv)
    needs only this tail between calls. ``initial`` is what stands before the
    first token: EOS ids for the n-gram context, zero rows for the conv. Not
    rewindable: rows that fall out of the window are gone.
    """

    def __init__(self, name: str, initial: mx.array):
        self.name = name
        self.initial = initial
        self.tail = initial
        self._position = 0
        # (window, tokens, start position) of the last traced extend
        self._traced: tuple[mx.array, int, int] | None = None
        self._tracing = False

    @property
    def position(self) -> int:
        return self._position

    @property
    def nbytes(self) -> int:
        return self.tail.nbytes

    @property
    def max_safe_rewind(self) -> int:
        return 0

    def extend(self, rows: mx.array) -> mx.array:
        """Append ``(L, ...)`` rows; return ``(tail + L, ...)``: the stored tail
        followed by *rows*, which is exactly the window a causal operator needs."""
        window = mx.concatenate([self.tail, rows], axis=0)
        self.tail = window[window.shape[0] - self.initial.shape[0] :]
        if self._tracing:
            self._traced, self._tracing = (window, rows.shape[0], self._position), False
        self._position += rows.shape[0]
        return window

    def trace(self) -> None:
        """Keep the window of the next :meth:`extend` (a speculative verify pass)."""
        self._tracing, self._traced = True, None

    def held_trace(self) -> tuple[mx.array, int, int] | None:
        """The last traced extend, for a :meth:`keep_traced` after later ones."""
        return self._traced

    def keep_traced(self, n: int, held: tuple[mx.array, int, int] | None = None) -> None:
        """Become the tail after the first *n* rows of the last traced extend, or
        of *held* (:meth:`held_trace`; later rows leave too)."""
        traced = self._traced if held is None else held
        self._traced = None
        if traced is None or not 0 <= n <= traced[1]:
            raise refuse_rewind(self.name, 0 if traced is None else traced[1] - n, 0)
        window, _, start = traced
        self.tail = window[n : n + self.initial.shape[0]]
        self._position = start + n

    def reset(self) -> None:
        self.tail = self.initial
        self._position = 0
        self._tracing, self._traced = False, None

    def rewind(self, n: int) -> None:
        if n != 0:
            raise refuse_rewind(self.name, n, 0)

    def arrays(self) -> list[mx.array]:
        return [self.tail]

    def snapshot(self) -> Snapshot:
        return {"tail": self.tail, "position": mx.array(self._position)}

    def restore(self, snapshot: Snapshot) -> None:
        self.tail = snapshot["tail"]
        self._tracing, self._traced = False, None
        self._position = int(snapshot["position"].item())


def new_state(arch: Qwen4ExpConfig, dtype: mx.Dtype) -> State:
    """A fresh session: every component at position 0 (conv tail rows in *dtype*)."""
    qsa_layers = len(arch.qsa_layers)
    return {
        "kv": KVComponent(qsa_layers),
        "gdn": GDNComponent(len(arch.gdn_layers)),
        "qsa": QSAComponent(qsa_layers, arch.qsa_block_size),
        "ngram_context": StreamTail(
            "ngram_context", mx.full((arch.ngram_n - 1,), arch.ngram_pad_id, dtype=mx.int32)
        ),
        "ple_conv_tail": StreamTail(
            "ple_conv_tail", mx.zeros((arch.ple_conv_rows, arch.hidden_size_per_layer_input), dtype)
        ),
    }
