"""Qwen3.5's multi-token-prediction head (``mtp.*``) as ``DraftPolicies.mtp``'s drafter.

The module (weights) is ``model.MtpHead``; this file binds it to the main
model for :class:`turbospark.generation.mtp.MultiTokenHead`.

One MTP step at position ``j`` reads the main model's hidden state there and
the token that follows it, and predicts the token after that (as vLLM's
``qwen3_next_mtp`` and ``qwen3_5_mtp`` compute it; Qwen3.5's ``config.json``
says ``mtp_num_hidden_layers: 1``)::

    e = pre_fc_norm_embedding(embed_tokens(x[j + 1]))
    h = pre_fc_norm_hidden(hidden[j])
    y = norm(layers[0](fc(concat([e, h]))))     # concat order: embedding first
    logits[j + 2] = lm_head(y)

- ``hidden[j]`` is the main model's *final-normed* hidden state (what its
  forward returns before the LM head; vLLM feeds the drafter the target's
  returned ``hidden_states``, which are after ``model.norm``).
- ``layers[0]`` is one gated full-attention decoder layer, the same kind as
  the main stack's full layers (own q/k/v/o, q/k norms, partial RoPE, its MLP),
  with its own K/V; its query at ``j`` is rotated by position ``j`` (the hidden
  state's position, as vLLM passes the target's positions).
- Deeper drafts apply the same layer again on its own output: step 2 reads
  ``y`` (normed) in place of ``hidden[j]`` with the drafted token, at ``j + 1``.
- ``embed_tokens`` and ``lm_head`` are the main model's (shared).
- Every RMSNorm here is stored zero-centred, like the main model's
  (``1 + w``; ``sanitize`` shifts them with the others).
"""

from __future__ import annotations

import mlx.core as mx

from turbospark.sdk import KVComponent, LayerKV, normed_input
from turbospark_qwen_gdn.model import MtpHead, QwenGdn


class QwenMtp:
    """The head bound to its model: what :class:`turbospark.generation.mtp.MultiTokenHead`
    asks of a family."""

    def __init__(self, model: QwenGdn):
        self.model = model
        self.head: MtpHead = model.mtp

    def new_cache(self, start: int) -> KVComponent:
        """Empty K/V for the MTP layer whose first entry will be at *start*."""
        layer = LayerKV()
        layer.base = start  # absolute position of row 0: RoPE and masks are by position
        return KVComponent.adopt("mtp", [layer], None, 0, start)

    def step(self, tokens: mx.array, hidden: mx.array, cache: KVComponent) -> mx.array:
        """Entries ``cache.position ..`` for ``tokens`` ``(L,)`` (each the token
        *after* its hidden state's position) and ``hidden`` ``(L, hidden)``;
        returns the normed outputs ``(L, hidden)`` (:meth:`logits` of row ``i``
        predicts the token after ``tokens[i]``). The cache advances by L."""
        start = cache.position
        head = self.head
        embedded = head.pre_fc_norm_embedding(self.model.model.embed_tokens(tokens))  # (L, H)
        fused = head.fc(mx.concatenate([embedded, head.pre_fc_norm_hidden(hidden)], axis=-1))
        layer = head.layers[0]
        out = layer(fused[None], cache, None, self.model._rope, start, None)  # (1, L, H)
        cache.advance(tokens.shape[0])
        # The layer's output may be unjoined (LayerEnd): the norm joins it.
        return normed_input(out, head.norm["weight"], head.norm.eps)[1][0]

    def logits(self, hidden: mx.array) -> mx.array:
        """float32 logits ``(L, vocab)`` through the main model's (shared) LM head."""
        return self.model.head(hidden).astype(mx.float32)
