"""``DraftPolicies.mtp``: drafts from the checkpoint's multi-token-prediction head.

The head (a family's :class:`~turbospark.contract.protocols.MultiTokenHead`; Qwen3.5's in
``turbospark_qwen_gdn.mtp``) has an attention layer of its own, so it keeps
K/V like the main model does. Its entry at position ``j`` is made from the
main model's hidden state at ``j`` and the token at ``j + 1``, so it can only
follow *verified* tokens: a session's
:class:`~turbospark.sessions.mtp_track.MtpTrack` holds

- ``cache``: the head's K/V over positions ``[cache start, cache.position)``;
- ``hidden``: the main model's hidden states by position, as every forward of
  the session hands them back (``turbospark_forward_with_hidden``), kept from
  the last one the cache read (it is redone when a cut reaches it) onward.

Both follow :meth:`Session.cut_to <turbospark.sessions.session.Session.cut_to>`: a cut to
``p`` (tokens ``0 .. p-1`` stay) keeps hidden states before ``p`` and cache
entries before ``p - 1`` (entry ``p - 1`` read the token at ``p``). So after a
round (``Runner.accept``) neither holds a rejected token, and a drafter's own
speculative entries are rewound before :meth:`MtpDrafter.propose` returns.

Where the record has a gap (a step decoded in a batch, which hands back no
hidden state; the part of a prompt reused from an earlier request; a session
restored from a snapshot) the cache restarts after it: the head then attends
over fewer tokens, its drafts are still verified, so output never changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from turbospark.contract.protocols import MultiTokenHead
from turbospark.generation.drafters import Draft
from turbospark.generation.sampling import Sampler
from turbospark.sessions.mtp_track import MtpTrack
from turbospark.state.kv import KVComponent


class MtpDrafter:
    """Proposes ``depth`` tokens with the MTP head: catch its cache up on the
    verified tokens, then step it on its own outputs (see the module docstring).

    At temperature 0 each draft is the head's argmax (greedy acceptance needs
    no ``q``); otherwise it is drawn from the head's distribution, warped as
    the request's sampler warps the target's, and that distribution is handed
    back as ``Draft.probs`` so rejection sampling stays exact.
    """

    def __init__(
        self, head: MultiTokenHead, track: Callable[[], MtpTrack], sampler: Sampler, depth: int
    ):
        """*track* gives the session's :class:`MtpTrack` when asked: the live
        session can change between requests, so it is looked up per proposal."""
        self.head = head
        self.track_of = track
        self.sampler = sampler
        self.max_depth = depth
        self.guesses_ahead = False  # its first step reads the confirmed token's id

    def propose(self, context: Sequence[int], depth: int) -> Draft:
        caught_up = self._catch_up(context[:-1], context[-1])
        if caught_up is None:
            return Draft([])
        out, cache, last = caught_up
        drafted, probs = [], []
        for i in range(depth):
            token, q = self._pick(self.head.logits(out)[0])
            drafted.append(token)
            probs.append(q)
            if i + 1 < depth:  # the next step reads this draft and the head's own output
                out = self.head.step(token.reshape(1), out, cache)
        tokens_out = mx.stack(drafted).tolist()
        if cache.position > last + 1:
            cache.rewind(cache.position - (last + 1))  # no unverified entry stays
        return Draft(tokens_out, None if probs[0] is None else mx.stack(probs))

    def propose_ahead(self, context: Sequence[int], depth: int) -> Draft:
        """Nothing as ids: the head's first step reads the unread token's id
        (:meth:`probe_after` drafts from it while it is still lazy)."""
        del context, depth
        return Draft([])

    def probe_after(self, fed: Sequence[int], pending: mx.array) -> mx.array | None:
        """One greedy draft ``(1,)``, still lazy, after every token of *fed* and
        the unread *pending* (a sampler's lazy output): a shadow probe queues it
        with the plain step that feeds *pending* and compares it with the token
        that step computes (no verify kernels, and no wait). Its argmax only
        sets the depth (a probe never emits a draft), so it takes no sampler
        key, at any temperature. None: no hidden state to draft from."""
        caught_up = self._catch_up(fed, pending.reshape(1).astype(mx.int32))
        if caught_up is None:
            return None
        out, _, _ = caught_up
        # The head's entry at the last fed position read *pending*: it stays, and
        # leaves with it (MtpTrack.cut) when *pending* turns out a stop.
        return mx.argmax(self.head.logits(out)[0]).astype(mx.int32).reshape(1)

    def _catch_up(
        self, fed: Sequence[int], confirmed: int | mx.array
    ) -> tuple[mx.array, KVComponent, int] | None:
        """Entries up to the last of *fed* (the last one reading the *confirmed*
        id: read, or lazy ``(1,)``): the head's output there ``(1, hidden)``, its
        cache, and that position; None without a hidden state there."""
        track = self.track_of()
        last = len(fed) - 1  # the last fed token
        if last < 0 or track.hidden_end != last + 1:  # no hidden state there: nothing to draft
            return None
        if track.cache is not None and track.cache.position > last:
            track.cut(last + 1)  # the entry at `last` read an older token: redo it
        if track.cache is None or track.cache.position < track.hidden_start:
            track.cache = self.head.new_cache(track.hidden_start)  # a gap: start after it
        cache = track.cache
        begin = cache.position
        # (L,): the token after each hidden state, the last one the confirmed id
        following = fed[begin + 1 : last + 1]
        if isinstance(confirmed, int):
            tokens = mx.array([*following, confirmed], dtype=mx.int32)
        elif following:
            tokens = mx.concatenate([mx.array(following, dtype=mx.int32), confirmed])
        else:
            tokens = confirmed
        out = self.head.step(tokens, track.rows(begin, last + 1), cache)[-1:]  # (1, hidden)
        track.release(last)  # keep h[last]: a cut may ask for its entry again
        return out, cache, last

    def _pick(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """A lazy draft id and the distribution it came from (None: greedy)."""
        if self.sampler.params.temperature == 0.0:
            return mx.argmax(logits).astype(mx.int32), None
        q = mx.softmax(self.sampler.warp(logits), axis=-1)
        token = mx.random.categorical(mx.log(q), key=self.sampler.next_key())
        return token.astype(mx.int32), q
