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

All five batch (:mod:`turbospark.state.kv`): ``kv`` and ``gdn`` are the core's
(left-padded K/V, stacked recurrent state), the two tails stack along the
batch axis (:class:`BatchStreamTail`), and ``qsa`` keeps each row's own
:class:`LayerIndex` side by side (:class:`BatchQSA`), because QSA picks key
blocks per query and so per row: the model runs those layers' attention row
by row over each row's K/V columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from turbospark.sdk import (
    BatchedComponent,
    Capabilities,
    ComponentSpec,
    GDNComponent,
    InvalidInput,
    KVComponent,
    LayeredComponent,
    Snapshot,
    State,
    refuse_rewind,
)

if TYPE_CHECKING:
    from turbospark_qwen4_exp.model import Qwen4ExpConfig


class LayerIndex:
    """The indexer cache of one QSA layer.

    ``keys`` holds the raw ``(tokens, index_head_dim)`` index key of every past
    token; ``pooled`` holds ``(blocks, index_head_dim)`` means of the keys of
    each *complete* block of ``block_size`` tokens. Both grow in ``step``-row
    chunks and are written in place, as :class:`~turbospark.state.kv.LayerKV`
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

    def view(self, fill: int) -> LayerIndex:
        """Another index over the same arrays holding the first *fill* tokens.

        Appends write only past their own ``fill``, so the two never see each
        other's tokens while neither goes below the other's fill: this is how
        a row joins a batch and leaves it without a copy (:class:`BatchQSA`)."""
        other = LayerIndex(self.block_size)
        other.keys, other.pooled, other.fill = self.keys, self.pooled, fill
        return other

    @staticmethod
    def _grown(buffer: mx.array | None, used: int, need: int, like: mx.array) -> mx.array:
        capacity = 0 if buffer is None else buffer.shape[0]
        if need <= capacity:
            return buffer
        grow = ((need - capacity + LayerIndex.step - 1) // LayerIndex.step) * LayerIndex.step
        extra = mx.zeros((grow, like.shape[1]), like.dtype)
        return extra if buffer is None else mx.concatenate([buffer[:used], extra], axis=0)

    def reserve(self, length: int, like: mx.array) -> None:
        """Room for *length* more keys (and the blocks they complete) shaped
        like *like*, so the next :meth:`append` of that length writes in place."""
        need = self.fill + length
        self.keys = self._grown(self.keys, self.fill, need, like)
        blocks = need // self.block_size
        if blocks > self.blocks:
            self.pooled = self._grown(self.pooled, self.blocks, blocks, like)

    def append(self, keys: mx.array) -> mx.array:
        """Append ``(L, index_head_dim)`` keys; return the pooled keys of every
        block complete after them, ``(blocks, index_head_dim)``."""
        length = keys.shape[0]
        old_blocks = self.blocks
        self.reserve(length, keys)
        self.keys[self.fill : self.fill + length] = keys
        self.fill += length
        new_blocks = self.blocks
        if new_blocks > old_blocks:
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

    # Not swappable: parking it is not proven lossless (see the module docstring).
    CAPABILITIES = Capabilities(swappable=False, rewindable=True, persistable=True, batchable=True)

    def __init__(self, num_layers: int, block_size: int):
        super().__init__("qsa", [LayerIndex(block_size) for _ in range(num_layers)])
        self.block_size = block_size

    @classmethod
    def merge(cls, parts: list[QSAComponent]) -> BatchQSA:
        """Several sessions' indexes side by side: a view of each, no copy. What
        a session's own index holds never changes: the batch writes only past
        its fill (see :meth:`LayerIndex.view`), so a failed batch leaves it intact."""
        layers = [
            [part.layers[i].view(part.layers[i].fill) for part in parts]
            for i in range(len(parts[0].layers))
        ]
        return BatchQSA(parts[0].block_size, layers)

    @classmethod
    def adopt(cls, layers: list[LayerIndex], block_size: int, position: int) -> QSAComponent:
        """A component made of existing *layers* at *position* (a row leaving a batch)."""
        component = cls(0, block_size)
        component.layers = layers
        component._position = position
        return component


class BatchQSA:
    """The ``qsa`` component of several sessions: per QSA layer, each row's
    own :class:`LayerIndex` (``layers[layer][row]``), side by side.

    QSA chooses key blocks per query, so rows never share a selection and
    the model runs these layers' attention row by row; keeping the rows'
    one-row indexes makes joining and leaving moves of references, and the
    indexer math exactly the one-row code's. A step appends to every row's
    index in place past its ``fill`` (after :meth:`prepare`), so the fills
    are all :meth:`hold` needs to undo it, and a row going back just drops
    its last keys, as :meth:`LayerIndex.rewind` does.
    """

    name = "qsa"

    def __init__(self, block_size: int, layers: list[list[LayerIndex]]):
        self.block_size = block_size
        self.layers = layers

    def __getitem__(self, index: int) -> list[LayerIndex]:
        return self.layers[index]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        return [a for rows in self.layers for row in rows for a in row.arrays()]

    def advance(self, n: int) -> None:
        del n  # positions are per row, kept by the rows themselves

    def extend(self, other: BatchedComponent) -> None:
        assert isinstance(other, BatchQSA)
        self.layers = [
            mine + theirs for mine, theirs in zip(self.layers, other.layers, strict=True)
        ]

    def filter(self, rows: list[int]) -> None:
        self.layers = [[layer[row] for row in rows] for layer in self.layers]

    def prepare(self, length: int) -> None:
        for layer in self.layers:
            for row in layer:
                if row.keys is not None:  # a fresh row allocates on its first append
                    row.reserve(length, row.keys)

    def hold(self) -> object:
        return [[row.fill for row in layer] for layer in self.layers]

    def rollback(self, held: object) -> None:
        assert isinstance(held, list)
        for layer, fills in zip(self.layers, held, strict=True):
            for row, fill in zip(layer, fills, strict=True):
                row.fill = fill

    def extract(self, row: int, position: int, back: int, held: object | None) -> QSAComponent:
        del held  # rewindable: a row going back drops its last keys
        layers = [layer[row].view(layer[row].fill - back) for layer in self.layers]
        return QSAComponent.adopt(layers, self.block_size, position)


class StreamTail:
    """The last ``rows`` rows of a stream (token ids, or embedding rows).

    A causal operator over a short window (an n-gram hash, a dilated conv)
    needs only this tail between calls. ``initial`` is what stands before the
    first token: EOS ids for the n-gram context, zero rows for the conv. Not
    rewindable: rows that fall out of the window are gone. Several sessions'
    tails merge into a :class:`BatchStreamTail`; both take and return a batch
    axis first, so the model calls either the same way.
    """

    # Not swappable: parking it is not proven lossless (see the module docstring).
    CAPABILITIES = Capabilities(
        swappable=False, rewindable=False, persistable=True, batchable=True, traceable=True
    )

    def __init__(self, name: str, initial: mx.array):
        self.name = name
        self.initial = initial
        self.tail = initial
        self._position = 0
        # (window, tokens, start position) of the last traced push
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

    def push(self, rows: mx.array) -> mx.array:
        """Append ``(1, L, ...)`` rows (one session: a batch of one); return
        ``(1, tail + L, ...)``: the stored tail followed by *rows*, which is
        exactly the window a causal operator needs."""
        window = mx.concatenate([self.tail, rows[0]], axis=0)
        self.tail = window[window.shape[0] - self.initial.shape[0] :]
        if self._tracing:
            self._traced, self._tracing = (window, rows.shape[1], self._position), False
        self._position += rows.shape[1]
        return window[None]

    @classmethod
    def merge(cls, parts: list[StreamTail]) -> BatchStreamTail:
        """Several sessions' tails stacked along the batch axis (a copy of a few rows each)."""
        first = parts[0]
        return BatchStreamTail(first.name, first.initial, mx.stack([p.tail for p in parts]))

    def trace(self) -> None:
        """Keep the window of the next :meth:`push` (a speculative verify pass):
        any tail after it is a slice of the window, which costs no kernel."""
        self._tracing, self._traced = True, None

    def held_trace(self) -> tuple[mx.array, int, int] | None:
        """The last traced push, for a :meth:`keep_traced` after later ones."""
        return self._traced

    def keep_traced(self, n: int, held: tuple[mx.array, int, int] | None = None) -> None:
        """Become the tail after the first *n* rows of the last traced push, or
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


class BatchStreamTail:
    """The tails of several sessions, ``(B, rows, ...)``: row ``i`` is session
    ``i``'s :class:`StreamTail`. Every row takes the same number of new rows a
    step (decode: one; a batched prefill: the same chunk length), so the
    window a causal operator needs is one concatenation for the whole batch.

    Not rewindable: a step replaces :attr:`tail` (never writes it in place), so
    :meth:`hold` keeps the reference from before it, which undoes a failed
    step and is what a row going back that step leaves with. Not traced: the
    engine's drafted rounds run alone, through the one-row component.
    """

    def __init__(self, name: str, initial: mx.array, tail: mx.array):
        self.name = name
        self.initial = initial  # one session's tail before its first token
        self.tail = tail
        self._step = 0  # rows the coming step appends (prepare)

    @property
    def nbytes(self) -> int:
        return self.tail.nbytes

    def arrays(self) -> list[mx.array]:
        return [self.tail]

    def advance(self, n: int) -> None:
        del n  # positions are per row, kept by the rows themselves

    def push(self, rows: mx.array) -> mx.array:
        """Append ``(B, L, ...)`` rows; return ``(B, tail + L, ...)``."""
        window = mx.concatenate([self.tail, rows], axis=1)
        self.tail = window[:, window.shape[1] - self.initial.shape[0] :]
        return window

    def extend(self, other: BatchedComponent) -> None:
        assert isinstance(other, BatchStreamTail)
        self.tail = mx.concatenate([self.tail, other.tail], axis=0)

    def filter(self, rows: list[int]) -> None:
        if rows == list(range(len(rows))):
            self.tail = self.tail[: len(rows)]
        else:
            self.tail = self.tail[mx.array(rows)]

    def prepare(self, length: int) -> None:
        self._step = length

    def hold(self) -> object:
        return self.tail, self._step

    def rollback(self, held: object) -> None:
        assert isinstance(held, tuple)
        self.tail = held[0]

    def extract(self, row: int, position: int, back: int, held: object | None) -> StreamTail:
        """Row *row* on its own at *position*; going back (the whole step, never
        part of it) reads the tail *held* before the step."""
        tail = self.tail
        if back:
            before, step = held if isinstance(held, tuple) else (None, 0)
            if before is None or back != step:
                raise refuse_rewind(self.name, back, step)
            tail = before
        one = StreamTail(self.name, self.initial)
        one.tail = mx.contiguous(tail[row])
        one._position = position
        return one


def check_batch_positions(state: State, positions: list[int]) -> None:
    """Refuse a batched step whose rows are not where their state stopped,
    before anything moves: the tails and the recurrent state only continue
    from there, and QSA reads a row's K/V as exactly its tokens so far. Each
    row's index keeps one key per token, so its fill is the row's position."""
    qsa = state["qsa"]
    assert isinstance(qsa, BatchQSA), "a batched step takes the merged state"
    for layer in qsa.layers[:1]:
        if len(layer) != len(positions):
            raise InvalidInput(
                f"a qwen4_exp batch of {len(layer)} rows was given {len(positions)} positions; "
                "pass one position per row"
            )
        for row, (index, position) in enumerate(zip(layer, positions, strict=True)):
            if index.fill != position:
                raise InvalidInput(
                    f"qwen4_exp batch row {row} is at position {index.fill}, asked to write at "
                    f"{position}; pass each row's own position"
                )


COMPONENTS = [
    ComponentSpec.of(
        KVComponent.CAPABILITIES, "kv", "keys/values of the query-sparse attention layers"
    ),
    # Not swappable here: this family has not proven parking lossless (above).
    ComponentSpec.of(
        GDNComponent.CAPABILITIES,
        "gdn",
        "per gated-DeltaNet layer: float32 recurrent matrix and conv tail",
        swappable=False,
    ),
    ComponentSpec.of(
        QSAComponent.CAPABILITIES,
        "qsa",
        "per QSA layer: raw index keys of every token and pooled block means",
    ),
    ComponentSpec.of(
        StreamTail.CAPABILITIES,
        "ngram_context",
        "the last ngram_n - 1 token ids (EOS before the first token)",
    ),
    ComponentSpec.of(
        StreamTail.CAPABILITIES,
        "ple_conv_tail",
        "the last (kernel - 1) * dilation n-gram embedding rows of the PLE conv",
    ),
]


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
