"""Scaled dot-product attention over a :class:`~turbospark.state.kv.LayerKV`.

Families compute queries/keys/values (with their own norms and RoPE) and call
:func:`cached_attention`; the KV layer decides which rows are retained and
which mask the window implies, so every family gets the same, tested masking.
A quantized cache (``--kv-bits``) hands back its rows quantized, and
:func:`attend` reads them through ``mx.quantized_matmul``
(:func:`quantized_attention`), so a family never knows which it runs on.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from turbospark.layers import fused
from turbospark.layers.cuda import attention as attention_cuda
from turbospark.state.kv import BatchLayerKV, LayerKV, QuantizedRows, Rows

# What a layer attended: keys, values and the mask (or, for the CUDA kernels, the
# whole buffers and the rows), which KV-shared layers attend over unchanged.
Attended = tuple[Rows, Rows, mx.array | str | attention_cuda.Rows | None]


def cached_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    kv: LayerKV | BatchLayerKV,
    scale: float,
) -> tuple[mx.array, Attended]:
    """Append ``keys``/``values`` (``(B, kv_heads, L, dim)``) to *kv* and attend.

    Returns the output ``(B, heads, L, dim)`` and ``(keys, values, mask)`` as
    attended, so KV-sharing layers can reuse them unchanged.
    """
    if (
        isinstance(kv, LayerKV | BatchLayerKV)
        and kv.quant is None
        and takes_kernels(queries, keys, values)
    ):
        # A decode step on CUDA: the kernels read the whole buffers (a batch's
        # rows each from its first past its padding).
        bounds = kv.update(keys, values)
        left = kv.first_rows() if isinstance(kv, BatchLayerKV) else None
        rows = attention_cuda.Rows(*bounds, left)
        return attend(queries, kv.keys, kv.values, scale, rows), (kv.keys, kv.values, rows)
    keys, values, key_start = kv.update_and_fetch(keys, values)
    mask = kv.mask(queries.shape[2], key_start, keys.shape[2])
    return attend(queries, keys, values, scale, mask), (keys, values, mask)


def takes_kernels(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether one query a row over these heads takes
    :mod:`~turbospark.layers.cuda.attention`'s kernels: on CUDA with their
    switch on, where the heads' shape fits them and all three share a dtype
    (the kernels read them as one type)."""
    return (
        queries.shape[2] == 1
        and queries.dtype == keys.dtype == values.dtype
        and attention_cuda.takes_shape(
            queries.shape[1] // keys.shape[1], keys.shape[3], values.shape[3]
        )
    )


def shared_attention(queries: mx.array, shared: Attended, scale: float) -> mx.array:
    """Attend over another layer's ``(keys, values, mask)`` (KV-shared layers)."""
    keys, values, mask = shared
    return attend(queries, keys, values, scale, mask)


# Apple GPUs have a fused one-token attention kernel for every head dim the
# families use; MLX's CUDA backend (0.32) runs their decode shapes through the
# op's fallback (calibrated against the H200's kernel counts: bench/gpu_kernels.py).
_FUSED_DECODE = mx.metal.is_available()
# Most scores (rows x heads x queries x keys) several queries take by matmuls on
# CUDA: 64 Mi, 128 MiB in bf16. A chat group (3 rows x 8 heads x 145 queries
# over 370 keys) holds 1.2 Mi; one row's 512-token chunk over 4k keys with 16
# heads, 32 Mi; a 2k-token chunk over 32k keys with 32 heads, 2 Gi (the op).
MATMUL_SCORES = 1 << 26
# Most scores one block of a long causal chunk holds where the op would hold
# them all (causal_blocks): 16 Mi, 64 MiB in float32. Measured on the CPU
# (a 2k-token chunk over 8k keys, 16 heads): peak 1.25 GB whole, 1.09 GB in
# 64 Mi blocks (MLX allocates a block's scores as it queues it, so blocks
# overlap), 0.36 GB in 16 Mi ones, in the same time.
BLOCK_SCORES = 1 << 24
# The widest head MLX's fused attention takes for several queries on a GPU
# (cuDNN's flash attention on CUDA, half types; Metal's full kernel). Past
# it, and on the CPU, the op falls back to ops that hold every score at once.
FUSED_PREFILL_HEAD_DIM = 128


def op_holds_scores(queries: mx.array, values: mx.array) -> bool:
    """Whether ``mx.fast.scaled_dot_product_attention`` of several queries
    falls back to ops that hold all ``(B, heads, L, T)`` scores (and their
    masked and softmaxed copies) at once: always on the CPU; on a GPU for
    heads wider than :data:`FUSED_PREFILL_HEAD_DIM` (the ~1B shapes' 256 and
    Gemma 4's 512-wide global heads) or float32 ones."""
    if mx.default_device() == mx.cpu:
        return True
    widest = max(queries.shape[-1], values.shape[-1])
    return widest > FUSED_PREFILL_HEAD_DIM or queries.dtype == mx.float32


def causal_blocks(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, rows: int
) -> mx.array:
    """``"causal"`` attention of ``(B, heads, L, D)`` queries over ``(B,
    kv_heads, T, D)`` keys, *rows* queries at a time, each block over only
    the keys it sees (block ``[r0, r1)``: the first ``T - L + r1``), so what
    it holds is one block's scores where the op's fallback holds all of them,
    and the keys past the block's last query are never scored. Every query
    row's softmax is its own, so the blocks give the whole's output (to
    rounding: a row's sums run over its visible keys only).

    On a GPU an uncompiled forward (a prefill chunk) evaluates each block
    before it queues the next (:func:`evaluates_blocks`): MLX allocates a
    block's scores when the host queues it, and the host runs ahead of the
    device, so queued together every block's scores were held at once (on
    an H100, qwen_gdn's 32k prompt: a 512-token chunk peaked at up to 6.1 GB
    this way, 3.4-4.2 GB evaluated block by block, mlx-lm's 3.9-4.2 GB)."""
    length, total = queries.shape[2], keys.shape[2]
    one_at_a_time = evaluates_blocks(queries.shape[0], length)
    outs: list[mx.array] = []
    for begin in range(0, length, rows):
        end = min(begin + rows, length)
        seen = total - length + end
        block = queries[:, :, begin:end]
        if outs and not one_at_a_time:  # scored once the block before is through
            block = mx.depends(block, outs[-1])
        outs.append(attend(block, keys[:, :, :seen], values[:, :, :seen], scale, "causal"))
        if one_at_a_time:
            mx.eval(outs[-1])
    return mx.concatenate(outs, axis=2)


def evaluates_blocks(batch: int, length: int) -> bool:
    """Whether :func:`causal_blocks` evaluates each block as it goes: on a
    GPU, where the forward is not traced (a compiled function cannot
    evaluate: :func:`~turbospark.layers.fused.runs_compiled`)."""
    return mx.default_device() == mx.gpu and not fused.runs_compiled(batch, length)


def attend(
    queries: mx.array,
    keys: Rows,
    values: Rows,
    scale: float,
    mask: mx.array | str | attention_cuda.Rows | None,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``, except on a GPU without a
    fused decode kernel (CUDA): one query per row (unmasked, or a batch's
    padding mask) takes :func:`decode_attention`, and several queries per row
    (a prefill chunk, a batched prefill group, a draft's verify pass)
    :func:`matmul_attention`.

    MLX's CUDA op sends several queries to cuDNN's fused attention, which
    builds a cuDNN graph the first time it meets each shape of queries, keys
    and mask: tens of milliseconds, where the forward it serves takes about
    ten. A server's prefill shapes rarely repeat (every chunk's key count
    grows; every group's rows and lengths differ), so it paid that build on
    almost every prefill (``bench/prefill_cost.py`` measures it). The
    matmul form costs the same for a shape met before and one not. It holds
    the scores whole, so past :data:`MATMUL_SCORES` of them (a long prompt's
    chunk over a long context) the op's fused kernel, whose build the chunk's
    own work then dwarfs, keeps them off the device's memory. The CPU keeps
    the op (its fallback), which costs it no more.

    A decode step on CUDA (:func:`takes_kernels`; a lone row's or a
    batch's) comes with :class:`~turbospark.layers.cuda.attention.Rows` for a
    mask and a cache's whole buffers, and takes that module's kernels: a lone
    row's traced once per buffer size; a batch's called as they are, since
    its buffers' size follows each merge of rows (a trace kept per size would
    pile up over a server's life).

    Where the op would fall back to holding every score at once
    (:func:`op_holds_scores`: the CPU, heads wider than cuDNN's), a
    ``"causal"`` chunk of more than :data:`BLOCK_SCORES` scores attends a
    block of queries at a time (:func:`causal_blocks`, each block then as
    above): a long prompt's peak memory is then a few blocks' scores, not
    the chunk's over the whole context.

    Quantized keys and values (a ``--kv-bits`` cache) take
    :func:`quantized_attention` on every device."""
    if isinstance(keys, QuantizedRows):
        assert isinstance(values, QuantizedRows) and not isinstance(mask, attention_cuda.Rows)
        return quantized_attention(queries, keys, values, scale, mask)
    assert isinstance(keys, mx.array) and isinstance(values, mx.array)
    if isinstance(mask, attention_cuda.Rows):
        if mask.left is None:
            return attention_cuda.decode_step(queries, keys, values, mask.bounds, scale)
        return attention_cuda.decode(queries, keys, values, mask.bounds, scale, mask.left)
    batch, heads, length, _ = queries.shape
    if isinstance(mask, str) and length > 1 and op_holds_scores(queries, values):
        rows = BLOCK_SCORES // (batch * heads * keys.shape[2])
        if rows < length:  # a long chunk over a long context: its scores a block at a time
            return causal_blocks(queries, keys, values, scale, max(1, rows))
    if fused.builds_for_gpu() and not _FUSED_DECODE:
        if length == 1 and not isinstance(mask, str):  # None, or a batch's padding mask
            return decode_attention(queries, keys, values, scale, mask)
        if (
            length > 1
            and mask is not None
            and batch * heads * length * keys.shape[2] <= MATMUL_SCORES
        ):
            return matmul_attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def quantized_attention(
    queries: mx.array,
    keys: QuantizedRows,
    values: QuantizedRows,
    scale: float,
    mask: mx.array | str | None,
) -> mx.array:
    """``(B, heads, L, D)`` queries over quantized ``(B, kv_heads, T, ·)`` keys
    and values: mlx-lm's ``quantized_scaled_dot_product_attention`` (scores
    and output by ``mx.quantized_matmul``, so the rows are never dequantized
    whole; each key/value head's queries one group of its matmuls; a masked
    score the dtype's lowest value; a precise softmax). *mask* is any of the
    caches' masks: ``"causal"``, ``(L, T)``, a batch's ``(B, 1, L, T)``."""
    batch, heads, length, dim = queries.shape
    kv_heads = keys.data.shape[1]
    group = heads // kv_heads
    queries = queries * scale
    k_parts, v_parts = keys.parts, values.parts
    if group > 1:
        queries = queries.reshape(batch, kv_heads, group, length, dim)
        k_parts = tuple(mx.expand_dims(part, -3) for part in k_parts)
        v_parts = tuple(mx.expand_dims(part, -3) for part in v_parts)
    quantized = {"group_size": keys.group_size, "bits": keys.bits}
    scores = mx.quantized_matmul(queries, *k_parts, transpose=True, **quantized)
    if mask is not None:
        if isinstance(mask, str):
            mask = causal_visible(length, scores.shape[-1])
        elif group > 1 and mask.ndim > 3:  # (B, 1, L, T) -> (B, 1, 1, L, T)
            mask = mx.expand_dims(mask, -3)
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *v_parts, transpose=False, **quantized)
    return out.reshape(batch, heads, length, -1)


def decode_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | None = None,
) -> mx.array:
    """One query per row, ``(B, heads, 1, D)`` over ``(B, kv_heads, T, D)``:
    MLX's attention fallback (scale the queries, scores, a precise softmax,
    the weighted values) with each key/value head's queries as the rows of
    one matmul, and no scaling kernel at scale 1.0 (Gemma 4's), where the
    fallback multiplies by 1 on every layer.

    With a batch's padding *mask* ``(B, 1, 1, T)`` (rows at different
    positions: :meth:`~turbospark.state.kv.BatchLayerKV.mask`), the scale and the
    mask go into the scores' matmul as one ``addmm`` over an additive bias
    (:func:`padding_bias`, built once for every layer given that mask), three
    kernels a layer where the fallback takes five (a scale, two matmuls, a
    select, a softmax)."""
    batch, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    # (B, heads, 1, D) -> (B, kv_heads, heads per kv head, D): the same memory
    rows = queries.reshape(batch, kv_heads, heads // kv_heads, dim)
    keys_t = keys.swapaxes(-1, -2)
    if mask is None:
        scores = (rows * scale if scale != 1.0 else rows) @ keys_t  # (B, kv_heads, group, T)
    else:
        bias = padding_bias(
            mask, (batch, kv_heads, heads // kv_heads, keys.shape[2]), queries.dtype
        )
        scores = mx.addmm(bias, rows, keys_t, alpha=scale)
    out = mx.softmax(scores, axis=-1, precise=True) @ values  # (B, kv_heads, group, Dv)
    return out.reshape(batch, heads, 1, -1)


_PADDING_BIASES: dict[tuple[int, tuple[int, ...], mx.Dtype], tuple[mx.array, mx.array]] = {}


def padding_bias(mask: mx.array, shape: tuple[int, int, int, int], dtype: mx.Dtype) -> mx.array:
    """A padding *mask* ``(B, 1, 1, T)`` as the additive bias of the scores'
    *shape* ``(B, kv_heads, group, T)`` (0 where it is True, ``-inf`` where
    not), whole (no broadcast for ``addmm``'s backends to handle). Kept while
    *mask* is the mask given: the layers of a step share one mask
    (:func:`~turbospark.state.kv.padding_mask`), so they share one bias, one
    kernel a step. The entry holds *mask*, so its ``id`` is not reused while
    it is kept."""
    key = (id(mask), shape, dtype)
    kept = _PADDING_BIASES.get(key)
    if kept is None or kept[0] is not mask:
        if len(_PADDING_BIASES) >= 8:
            _PADDING_BIASES.clear()
        bias = mx.where(
            mx.broadcast_to(mask, shape), mx.array(0.0, dtype), mx.array(-mx.inf, dtype)
        )
        kept = _PADDING_BIASES[key] = (mask, bias)
    return kept[1]


@lru_cache(maxsize=8)
def causal_bias(shape: tuple[int, int, int, int], queries: int, dtype: mx.Dtype) -> mx.array:
    """The ``"causal"`` mask of the last *queries* positions over the keys as
    an additive bias of the scores' *shape*, ``(B, kv_heads, group * queries,
    T)`` (0 where query ``i`` sees key ``j <= T - queries + i``, ``-inf`` past
    it; each key/value head's query heads one after another). Built on the
    host in *dtype*, so it costs no kernel, a pass's layers share it, and it
    is whole (no broadcast for ``addmm``'s backends to handle)."""
    keys = shape[-1]
    visible = np.arange(keys)[None] <= np.arange(keys - queries, keys)[:, None]
    bias = np.where(visible, 0.0, -np.inf).astype(np.float32)  # (queries, T)
    rows = np.tile(bias, (shape[2] // queries, 1))  # (group * queries, T)
    return mx.array(np.ascontiguousarray(np.broadcast_to(rows, shape)), dtype=dtype)


def causal_visible(queries: int, keys: int) -> mx.array:
    """The ``"causal"`` mask as booleans ``(queries, keys)`` (bottom-right
    aligned: query ``i`` sees key ``j <= keys - queries + i``), on the device."""
    return mx.arange(keys)[None] <= mx.arange(keys - queries, keys)[:, None]


def matmul_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str,
) -> mx.array:
    """Several queries per row, ``(B, heads, L, D)`` over ``(B, kv_heads, T,
    D)``: :func:`decode_attention`'s matmuls, each key/value head's queries
    (all L of each) the rows of one. A lone row's few ``"causal"`` queries (a
    verify pass, :func:`~turbospark.layers.fused.runs_compiled`) scale the
    scores and add the mask in their matmul (:func:`causal_bias`, one
    ``addmm`` to ``(B, kv_heads, group * L, T)``), three kernels a layer where
    the fallback takes eight. Any other mask (a prefill chunk's ``"causal"``, a
    window's ``(L, T)``, a batch's ``(B, 1, L, T)``) is selected as MLX's
    fallback selects it, so the form holds for every prompt length: no bias
    the size of the scores is built on the host."""
    batch, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    # (B, heads, L, D) -> (B, kv_heads, group * L, D): the same memory at L = 1
    rows = queries.reshape(batch, kv_heads, group * length, dim)
    keys_t = keys.swapaxes(-1, -2)
    if isinstance(mask, str) and fused.runs_compiled(batch, length):
        shape = (batch, kv_heads, group * length, keys.shape[2])
        scores = mx.addmm(causal_bias(shape, length, queries.dtype), rows, keys_t, alpha=scale)
    else:
        if isinstance(mask, str):
            mask = causal_visible(length, keys.shape[2])
        elif mask.ndim == 4:  # (B, 1, L, T) -> (B, 1, 1, L, T): one for every group
            mask = mask[:, :, None]
        scores = (rows * scale if scale != 1.0 else rows) @ keys_t
        scores = scores.reshape(batch, kv_heads, group, length, -1)
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        scores = scores.reshape(batch, kv_heads, group * length, -1)
    out = mx.softmax(scores, axis=-1, precise=True) @ values  # (B, kv_heads, group * L, Dv)
    return out.reshape(batch, heads, length, -1)


# Every graph node costs host time to build and schedule, a view too. For one
# token (decode) ``(B, 1, n*D)`` and ``(B, n, 1, D)`` are the same memory, so
# the heads axis comes first with one reshape, where a prompt needs a reshape
# and a transpose.


def heads_first(x: mx.array, n: int) -> mx.array:
    """``(B, L, n*D) -> (B, n, L, D)``."""
    batch, length, _ = x.shape
    if length == 1:
        return x.reshape(batch, n, 1, -1)
    return x.reshape(batch, length, n, -1).transpose(0, 2, 1, 3)


def normed_heads(x: mx.array, n: int, weight: mx.array | None, eps: float) -> mx.array:
    """``(B, L, n*D) -> (B, n, L, D)``, each head RMS-normed (``nn.RMSNorm``'s
    op; *weight* None: no scale), the norm before the transpose as the
    reference models do. A decode step's ``(B, n*D)`` (one token a row) is
    ``L = 1``."""
    if x.ndim == 2 or x.shape[1] == 1:
        return mx.fast.rms_norm(x.reshape(x.shape[0], n, 1, -1), weight, eps)
    batch, length, _ = x.shape
    return mx.fast.rms_norm(x.reshape(batch, length, n, -1), weight, eps).transpose(0, 2, 1, 3)


def merge_heads(x: mx.array) -> mx.array:
    """``(B, n, L, D) -> (B, L, n*D)`` (an attention output, back to the hidden layout)."""
    batch, _, length, _ = x.shape
    if length == 1:
        return x.reshape(batch, 1, -1)
    return x.transpose(0, 2, 1, 3).reshape(batch, length, -1)
