"""Tensor parallelism on ``mlx.distributed``: the helpers a family shards with.

A family implements :func:`turbospark.contract.hookspecs.turbospark_shard_model` in a
few lines by calling these on its blocks. The recipe is Megatron's, as mlx-lm
applies it (the ``shard`` methods of its llama and qwen3_5 models), built on MLX's own
``shard_linear`` (``AllToShardedLinear`` / ``ShardedToAllLinear``):

- the projections *into* heads (q, k, v; an MLP's gate and up) become
  all-to-sharded: every rank reads the whole hidden state and computes its
  own contiguous slice of heads, with no communication;
- the projections *out of* heads (o; the MLP's down) become sharded-to-all:
  each rank multiplies its slice and one ``all_sum`` restores the full hidden
  state, identical on every rank.

So each rank holds ``1/N`` of the heads, and the per-session state a head
writes (attention K/V, gated-DeltaNet conv tail and recurrent state) is sized
from the sharded projections: it is sharded by head with no change to the
state classes. Embeddings, norms and the head stay whole on every rank.

Every check runs before a weight moves, and a world size that does not divide
a head count is refused by name (:class:`~turbospark.errors.InvalidInput`).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear

from turbospark.errors import InvalidInput
from turbospark.layers.gated_delta.layer import GatedDeltaNet
from turbospark.layers.mlp import GatedMLP


def require_divisible(group: mx.distributed.Group, **counts: int) -> None:
    """Refuse a world size that does not divide each named count (heads, widths)."""
    size = group.size()
    for name, count in counts.items():
        if count % size:
            raise InvalidInput(
                f"world size {size} does not divide {name}={count}: launch a number of "
                f"processes that does ({_divisors(count)})"
            )


def _divisors(count: int) -> str:
    """The group sizes that divide *count* (the suggestion in refusals)."""
    sizes = [d for d in range(2, min(count, 64) + 1) if count % d == 0][:4]
    return "mlx.launch -n " + " or ".join(map(str, sizes)) if sizes else "no group of 2 or more"


def kv_copies(group: mx.distributed.Group, heads: int, kv_heads: int) -> int:
    """How many times each K/V head is repeated so every rank has one for its
    queries: 1 when the world size divides ``kv_heads``, else ``N / kv_heads``
    (mlx-lm's rule for GQA models with fewer K/V heads than ranks)."""
    size = group.size()
    require_divisible(group, num_attention_heads=heads)
    if kv_heads % size == 0:
        return 1
    if size % kv_heads:
        raise InvalidInput(
            f"world size {size} neither divides nor is a multiple of num_key_value_heads="
            f"{kv_heads}: launch a number of processes that does ({_divisors(kv_heads)})"
        )
    return size // kv_heads


def _repeat_heads(linear: nn.Linear, heads: int, copies: int) -> None:
    """Repeat each of *heads* output blocks of *linear* *copies* times, in place."""
    if copies == 1:
        return
    for name in ("weight", "bias"):
        if name in linear:
            value = linear[name]
            shape = value.shape
            value = value.reshape(heads, shape[0] // heads, *shape[1:])  # (heads, D, ...)
            value = mx.repeat(value, copies, axis=0).reshape(-1, *shape[1:])
            linear[name] = value


def shard_attention(
    attn: nn.Module,
    group: mx.distributed.Group,
    *,
    heads: int,
    kv_heads: int,
    kv_projections: tuple[str, ...] = ("k_proj", "v_proj"),
) -> tuple[int, int]:
    """Shard an attention block's ``q_proj``/``o_proj`` and *kv_projections* by
    head (a block that owns no K/V passes ``kv_projections=()``). Returns the
    per-rank ``(heads, kv_heads)`` the block must now use.

    ``q_proj`` may emit more than one tensor per head (Qwen's query + gate):
    its rows are grouped by head, so a contiguous split is still a split by head.
    """
    copies = kv_copies(group, heads, kv_heads)
    attn.q_proj = shard_linear(attn.q_proj, "all-to-sharded", group=group)
    for name in kv_projections:
        linear = getattr(attn, name)
        _repeat_heads(linear, kv_heads, copies)
        setattr(attn, name, shard_linear(linear, "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    return heads // group.size(), kv_heads * copies // group.size()


def shard_mlp(mlp: GatedMLP, group: mx.distributed.Group) -> None:
    """Shard a gated MLP's inner width: gate/up all-to-sharded, down sharded-to-all."""
    require_divisible(group, intermediate_size=mlp.gate_proj.weight.shape[0])
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_gated_delta(gdn: GatedDeltaNet, group: mx.distributed.Group) -> None:
    """Shard a gated-DeltaNet mixer by head: q/k/v (through the depthwise conv,
    whose channels are the same q | k | v segments), z, the per-head decay and
    step size, and ``out_proj``. Its state (conv tail, recurrent matrix) then
    holds this rank's heads only."""
    d = gdn.dims
    require_divisible(
        group, linear_num_key_heads=d.num_key_heads, linear_num_value_heads=d.num_value_heads
    )
    size, rank = group.size(), group.rank()
    segments = [d.key_dim, 2 * d.key_dim]  # q | k | v: each segment split on its own
    shard_inplace(gdn.in_proj_qkv, "all-to-sharded", segments=segments, group=group)
    shard_inplace(gdn.conv1d, lambda path, weight: (0, segments), group=group)
    for name in ("in_proj_z", "in_proj_a", "in_proj_b"):
        shard_inplace(getattr(gdn, name), "all-to-sharded", group=group)
    gdn.A_log = mx.contiguous(mx.split(gdn.A_log, size)[rank])
    gdn.dt_bias = mx.contiguous(mx.split(gdn.dt_bias, size)[rank])
    gdn.out_proj = shard_linear(gdn.out_proj, "sharded-to-all", group=group)
    gdn.dims = dataclasses.replace(
        d, num_key_heads=d.num_key_heads // size, num_value_heads=d.num_value_heads // size
    )


def check_same_install(group: mx.distributed.Group, digest: str, source: str) -> None:
    """Refuse, on every rank at once, models that differ across the group; *digest*
    is the verified manifest's (``loading.install.manifest_digest``), *source* names
    what this rank opened."""
    check_agree(
        group,
        "models (verified manifests)",
        digest,
        f"open the same checkpoint on every rank (this rank's: {source})",
    )


def check_agree(group: mx.distributed.Group, what: str, digest: str, fix: str) -> None:
    """Compare every rank's sha256 hex *digest* of *what* (one ``all_gather``);
    when any differs, raise on all ranks at once, naming the ranks and the fix."""
    mine = mx.array(list(bytes.fromhex(digest)), dtype=mx.uint8)[None]  # (1, 32)
    every = mx.distributed.all_gather(mine, group=group).tolist()  # (N, 32)
    digests = [bytes(row).hex() for row in every]
    odd = [rank for rank, other in enumerate(digests) if other != digests[0]]
    if odd:
        raise InvalidInput(
            f"mismatched {what} across ranks: rank(s) {odd} differ from rank 0 (sha256 "
            f"{digests[odd[0]][:12]} vs {digests[0][:12]}); {fix}"
        )
