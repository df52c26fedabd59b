"""Speculative decoding: verify a round of drafts in one forward, keep what the target agrees with.

A round, for a confirmed token ``t`` (sampled, not yet fed) at ``position``:

1. the drafter (:mod:`turbospark.generation.drafters`) proposes ``d_1 .. d_k`` after ``t``;
2. :meth:`Runner.verify` feeds ``[t, d_1 .. d_k]`` in one forward and returns
   logits for every position (row ``i`` predicts the token after ``d_i``);
3. acceptance (:func:`accept_greedy`, :func:`accept_sampled`) keeps the
   longest prefix ``d_1 .. d_a`` the target agrees with and draws the token
   after it from the target (a correction, or a bonus when all ``k`` passed);
4. :meth:`Runner.accept` keeps ``t, d_1 .. d_a`` in state: attention K/V
   rewinds, recurrent state (GDN, conv tails) takes the state the verify pass
   traced at that token. No second forward, and no rejected token stays in the
   session (or its record) once the round is over.

At temperature 0 a draft passes when it equals the target's argmax, so the
output is token for token what decoding without drafts gives. With sampling,
a draft ``x`` drawn from ``q`` passes with probability ``min(1, p(x) / q(x))``
and a rejection draws from ``max(0, p - q)`` renormalised (Leviathan et al.,
2023; Chen et al., 2023), so every emitted token has exactly the target's
distribution ``p`` (the sampler's warped logits: temperature, top-k, top-p).
A deterministic drafter's ``q`` is a point mass at its token.

Adaptive depth (:class:`DepthControl`): drafting starts at depth 1; a round
whose drafts all pass doubles the depth (up to ``max_depth``); a partial one
drafts one past what passed; a round (or probe) with nothing accepted drops
it to 1 and pauses drafting for 1, 2, 4, 8 steps (plain pipelined decode)
before the next depth-1 probe, and 8 from then on until a draft passes (the
MTP head, whose probes run the head: 1, 4, 16 ... steps, without a bound). A
drafter that proposes nothing pauses at most 8 steps too.

Shadow probes (:meth:`Speculation.probe`): until a drafter has been right (an
MTP head gets one real round first), and again after every round with nothing
accepted, a drafted step is not a round (which waits for the confirmed token,
then for the verify pass) but a plain pipelined step beside which the drafter
guesses the token that step computes: a lookup drafter (prompt lookup, the
benchmark's oracles) looks it up once the fed id is read, from the same context
a round after that id would (:meth:`Drafter.propose` at depth 1); the MTP
head drafts it from the still-lazy id, queued with the step
(:meth:`MtpDrafter.probe_after <turbospark.generation.mtp.MtpDrafter.probe_after>`). The
guess is compared with that token when the loop reads it anyway
(:meth:`Speculation.observe`), and only sets the depth: a hit resumes real
rounds from the step after the one that reads it, a miss pauses. A probe
verifies nothing, so no device work at all for a lookup (the head's own
forward for MTP), no wait, and no state to cut; a drafter that is never right
costs a lookup every few steps (a few µs, against a step's milliseconds). Lookups could run every step for that price; the
pauses stay because every hit starts a real round, and a drafter that is
right only now and then pays for those in verify passes. What a probe measures is what a real depth-1 round there
would have accepted: at temperature 0 the draft passes exactly when it equals
the target's argmax, which is the token the plain step emits; with sampling, a
point-mass draft ``x`` passes a round with probability ``min(1, p(x) / 1) =
p(x)``, and the plain step's token equals ``x`` with probability ``p(x)``, so a
hit is an unbiased sample of the round's acceptance (the MTP head's probe
guesses its argmax, so it estimates a greedy head's acceptance). The engine's
solo rows probe and draft the same way, one row at a time.

Chained rounds (greedy; :meth:`Speculation.launch_after`): a round is queued
(:meth:`Speculation.launch`: drafts, the verify pass and the target's choices
computed on the device, nothing read) and, once two rounds in a row passed
whole, the next round is queued behind it before it is read: its first token
is this round's unread bonus, its drafts are guessed past it. The host then
builds round ``r + 1`` while round ``r`` computes, and reads each round once.
A round read short is cut back inside itself through its held traces
(:meth:`Runner.hold`), and the round behind it leaves with everything after
the cut; so between steps the session may hold one unread round, never once
the reply is over (nor when its consumer stops reading).

A request drafts only when it decodes alone through the one-row forward (an
engine's solo rows; every row of ``generate``'s one-row engine) and samples
without logits processors or logprobs (those see every sampled token one at a
time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from turbospark.generation.drafters import Draft, Drafter, drafter_for
from turbospark.generation.mtp import MtpDrafter
from turbospark.generation.opening import check_rollback
from turbospark.generation.runner import Runner
from turbospark.generation.sampling import Sampler
from turbospark.sessions.session import Session

# The longest pause between probes of a drafter that only looks its guesses up (or
# keeps proposing nothing): such a probe costs a lookup, no device work (a shadow
# probe), and prompt lookup finds matches in bursts, so a drafter that turns right
# after a hopeless stretch is drafting again within MAX_IDLE_PAUSE + 2 steps.
MAX_IDLE_PAUSE = 8
# An MTP head's probe runs the head (its catch-up and one step), so its pauses grow
# by this after each miss, without a bound.
MTP_BACKOFF = 4


# -- acceptance -------------------------------------------------------------------


def accept_greedy(logits: mx.array, drafts: Sequence[int]) -> tuple[int, int]:
    """``(accepted, next)``: drafts pass while they equal the argmax of the
    row before them; *next* is the argmax after the last one that passed.
    *logits* ``(k + 1, vocab)``."""
    choice = mx.argmax(logits, axis=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
        accepted += 1
    return accepted, choice[accepted]


def accept_sampled(logits: mx.array, draft: Draft, sampler: Sampler) -> tuple[int, int]:
    """``(accepted, next)`` by rejection sampling with residual correction.

    Draft ``i`` (drawn from ``q_i``) passes with probability
    ``min(1, p_i(d_i) / q_i(d_i))``; the first rejected one is replaced by a
    draw from ``max(0, p_i - q_i)`` renormalised; when all pass, the bonus
    token is drawn from ``p_k``. ``p`` is the target's distribution as the
    sampler would draw from it (:meth:`Sampler.warp`). *logits* ``(k + 1, vocab)``.
    """
    k = len(draft.tokens)
    p = mx.softmax(mx.stack([sampler.warp(row) for row in logits]), axis=-1)  # (k + 1, vocab)
    drafted = mx.array(draft.tokens, dtype=mx.int32)
    rows = mx.arange(k)
    p_drafted = p[rows, drafted]  # (k,)
    if draft.probs is None:
        q = mx.zeros((k, p.shape[-1]), p.dtype)
        q[rows, drafted] = 1.0  # a deterministic drafter: point masses
    else:
        q = draft.probs.astype(p.dtype)
    q_drafted = q[rows, drafted]
    # u < p/q, written without the division (q is 1 for point masses).
    passed = (
        mx.random.uniform(shape=(k,), key=sampler.next_key()) * q_drafted < p_drafted
    ).tolist()
    accepted = passed.index(False) if False in passed else k
    if accepted == k:
        target = p[k]
    else:
        target = mx.maximum(p[accepted] - q[accepted], 0.0)
        # p == q leaves nothing (and then the draft always passes): fall back to p.
        target = mx.where(target.sum() > 0, target, p[accepted])
    following = mx.random.categorical(mx.log(target), key=sampler.next_key())
    return accepted, int(following.item())


# -- adaptive depth ---------------------------------------------------------------


@dataclass
class DepthControl:
    """How deep the next round drafts (see the module docstring)."""

    max_depth: int
    depth: int = 1  # start shallow: a drafter earns depth by being right
    pause: int = 0  # plain steps left before the next probe
    backoff: int = 1  # the next pause's length
    growth: int = 2  # how much each miss lengthens the next pause
    cap: int | None = MAX_IDLE_PAUSE  # the longest pause after a miss (None: no bound)
    shadow: bool = True  # nothing accepted yet (or since the last miss): probe, not a round
    streak: int = 0  # rounds in a row whose drafts all passed (2 or more: chain them)

    def after_whole(self) -> int:
        """The depth the next round drafts if the one in flight passes whole."""
        return min(self.max_depth, 2 * self.depth)

    def next_depth(self) -> int:
        """The depth to draft now; 0 while paused (the step decodes plainly)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.depth

    def record(self, proposed: int, accepted: int) -> None:
        self.shadow = accepted == 0
        self.streak = self.streak + 1 if proposed and accepted == proposed else 0
        if proposed and accepted == proposed:
            self.depth = min(self.max_depth, 2 * self.depth)
            self.backoff = 1
        elif accepted:
            self.depth = max(1, accepted + 1)
            self.backoff = 1
        elif proposed:  # nothing passed: pause, longer each time, then probe at depth 1
            self.depth = 1
            self.pause = self.backoff
            self.backoff *= self.growth
            if self.cap is not None:
                self.backoff = min(self.cap, self.backoff)
        else:  # nothing proposed: ask again soon (a lookup costs no verify)
            self.pause = min(self.backoff, MAX_IDLE_PAUSE)
            self.backoff = min(MAX_IDLE_PAUSE, 2 * self.backoff)


# -- a request's drafting ----------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """A verified round: the confirmed token and the drafts that passed (all fed,
    uncommitted until :meth:`Speculation.commit`), and the target's next token."""

    tokens: list[int]
    following: int
    proposed: int


@dataclass
class Queued:
    """A greedy round queued and not read yet (:meth:`Speculation.launch`)."""

    position: int
    token: int | None  # the confirmed token; None until read (a chained round's is lazy)
    drafts: list[int]
    choice: mx.array  # (k + 1,): the target's greedy token after each fed one
    bonus: mx.array  # choice's last entry, evaluated with it (a chained round feeds it unread)
    held: dict[str, object] | None = None  # its traces, once a round is queued behind it

    @property
    def fed(self) -> int:
        return 1 + len(self.drafts)


@dataclass
class Speculation:
    """One request's drafting: its drafter, adaptive depth and counts.

    *generated* is the caller's list of emitted tokens (read, never written):
    with *prompt* it is the context the drafter continues.
    """

    runner: Runner
    sampler: Sampler
    drafter: Drafter
    prompt: Sequence[int]
    generated: list[int]
    session: Session | None = None  # None: the runner's live session
    control: DepthControl = field(init=False)
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    probed: int = 0  # shadow probes: guesses compared with a plain step's token (see probe())
    # A shadow probe's guess (an MTP head's still lazy) for the token at this position,
    # compared when the loop reads that token (observe()).
    _guess: tuple[int, int | mx.array] | None = field(default=None, init=False)
    _lookup_at: int | None = field(default=None, init=False)  # a lookup to make once read

    def __post_init__(self) -> None:
        # A checkpoint's MTP head was trained to be right: its first round is a real
        # one (it waits); only after a miss does it earn rounds back through probes.
        mtp = self._mtp is not None
        self.control = DepthControl(
            self.drafter.max_depth,
            shadow=not mtp,
            growth=MTP_BACKOFF if mtp else 2,
            cap=None if mtp else MAX_IDLE_PAUSE,
        )

    @property
    def _mtp(self) -> MtpDrafter | None:
        """The MTP drafter, whose probe drafts from the unread id on the device
        (:meth:`MtpDrafter.probe_after`) rather than looking a guess up."""
        return self.drafter if isinstance(self.drafter, MtpDrafter) else None

    @property
    def shadow(self) -> bool:
        """Whether the next drafted step should be a shadow :meth:`probe` (nothing
        accepted yet, or since the last miss) rather than a :meth:`round`."""
        return self.control.shadow

    @property
    def probing(self) -> bool:
        """A probe's guess is not compared yet: the step after it is plain (reading
        its token earlier would wait for the step that computes it)."""
        return self._guess is not None or self._lookup_at is not None

    def probe(self, pending: mx.array, position: int) -> None:
        """A shadow probe beside the plain step that feeds the still-lazy *pending*
        at *position* (the caller queues that step, and calls :meth:`observe` with
        each token it reads): the drafter's guess for the token that step
        computes, at ``position + 1``, is compared with it once read, as a
        depth-1 round there would have been decided (see the module docstring).
        Nothing is verified, fed or cut. A lookup drafter guesses once
        *pending* is read (:meth:`observe`: the same context a round would
        draft from); the MTP head drafts from *pending* itself, queued now
        with the step, so reading its guess waits for nothing."""
        if self._mtp is None:
            self._lookup_at = position + 1
            return
        lazy = self._mtp.probe_after([*self.prompt, *self.generated], pending)
        if lazy is None:
            self.control.record(0, 0)
            return
        mx.async_eval(lazy)
        self._guess = (position + 1, lazy)
        self.probed += 1

    def observe(self, token: int, position: int, ends: bool = False) -> None:
        """The loop read *token*, fed (or to be fed) at *position*: settle the
        probe that guessed it (a hit resumes rounds, a miss pauses), and make a
        lookup probe's guess for the token after it, unless the reply *ends*
        with *token* (a stop id, or its last token)."""
        if self._guess is not None and self._guess[0] <= position:
            (at, guess), self._guess = self._guess, None
            if at == position:  # (an older one: the row decoded in a batch since)
                hit = (guess if isinstance(guess, int) else int(guess.item())) == token
                self.control.record(1, int(hit))
        lookup, self._lookup_at = self._lookup_at, None
        if lookup != position + 1 or ends:
            return
        # The context a round after *token* drafts from (the caller may have
        # appended *token* to its generated list already).
        context = [*self.prompt, *self.generated[: position - len(self.prompt)], token]
        guess = self.drafter.propose(context, 1).tokens
        if not guess:
            self.control.record(0, 0)
            return
        self._guess = (position + 1, guess[0])
        self.probed += 1

    def plan(self, position: int, remaining: int | None) -> int:
        """How many drafts the step at *position* may verify (0: a plain step).
        Never more than the reply has left after the confirmed token (whose
        last token is not fed), nor than the context has room for."""
        room = self.runner.context_length - position - 1
        cap = room if remaining is None else min(room, remaining - 1)
        if cap <= 0:
            return 0
        return min(cap, self.control.next_depth())

    def round(self, token: int, position: int, depth: int) -> Round | None:
        """Draft after *token*, verify, and decide; None when the drafter had
        nothing (the caller takes a plain step). State holds the round's tokens
        fed (traced) until :meth:`commit`."""
        context = [*self.prompt, *self.generated, token]
        draft = self.drafter.propose(context, depth)
        drafts = draft.tokens[:depth]
        if not drafts:
            self.control.record(0, 0)
            return None
        if len(drafts) < len(draft.tokens):
            probs = None if draft.probs is None else draft.probs[: len(drafts)]
            draft = Draft(drafts, probs)
        logits = self.runner.verify(self.session, [token, *drafts], position)
        if self.sampler.params.temperature == 0.0:
            accepted, following = accept_greedy(logits, drafts)
        else:
            accepted, following = accept_sampled(logits, draft, self.sampler)
        self.control.record(len(drafts), accepted)
        self.proposed += len(drafts)
        self.accepted += accepted
        self.rounds += 1
        return Round([token, *drafts[:accepted]], following, len(drafts))

    @property
    def greedy(self) -> bool:
        """Temperature 0: rounds are queued and read once (:meth:`launch`)."""
        return self.sampler.params.temperature == 0.0

    @property
    def chains(self) -> bool:
        """Queue the next round before this one is read (:meth:`launch_after`):
        greedy, a drafter that can guess past an unread token, and the last two
        rounds passed whole, so this one likely does too (a round queued behind
        one read short is built for nothing)."""
        return self.greedy and self.drafter.guesses_ahead and self.control.streak >= 2

    def launch(self, token: int, position: int, depth: int) -> Queued | None:
        """Queue a greedy round after the confirmed *token* (read): drafts, one
        verify pass, and the target's choices, all unread. None: the drafter had
        nothing (the caller takes a plain step)."""
        drafts = self.drafter.propose([*self.prompt, *self.generated, token], depth).tokens
        if not drafts[:depth]:
            self.control.record(0, 0)
            return None
        return self._queue(token, drafts[:depth], position)

    def launch_after(self, queued: Queued, remaining: int | None) -> Queued | None:
        """Queue the round that follows *queued* if it passes whole: its first
        token is *queued*'s unread bonus, its drafts guessed past it
        (:meth:`Drafter.propose_ahead`). Waits for *queued* to finish computing
        (not for this one). None when the reply or the context has no room for
        it, or the drafter had nothing; *queued*'s traces are held, so it can
        still be cut anywhere (:meth:`cut`)."""
        position = queued.position + queued.fed
        if remaining is not None:
            remaining -= queued.fed
        room = self.runner.context_length - position - 1
        cap = room if remaining is None else min(room, remaining - 1)
        depth = min(cap, self.control.after_whole())
        if depth <= 0:
            return None
        assert queued.token is not None
        context = [*self.prompt, *self.generated, queued.token, *queued.drafts]
        drafts = self.drafter.propose_ahead(context, depth).tokens[:depth]
        if not drafts:
            return None
        queued.held = self.runner.hold(self.session)
        after = self._queue(queued.bonus, drafts, position)
        after.token = int(queued.bonus.item())  # read by the verify, after queueing it
        return after

    def _queue(self, token: int | mx.array, drafts: list[int], position: int) -> Queued:
        def choose(logits: mx.array) -> tuple[mx.array, mx.array]:
            choice = mx.argmax(logits, axis=-1)  # (k + 1,)
            # Evaluated with the pass (a view: no kernel), so a chained round reads it
            # without queueing anything behind the round it feeds.
            return choice, choice[-1]

        choice, bonus = self.runner.verify(self.session, [token, *drafts], position, then=choose)
        first = token if isinstance(token, int) else None
        return Queued(position, first, drafts, choice, bonus)

    def resolve(self, queued: Queued) -> Round:
        """Read a queued round's choices (the one wait per round) and decide:
        drafts pass while they equal the target's choice before them."""
        assert queued.token is not None
        choice = queued.choice.tolist()
        drafts = queued.drafts
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
            accepted += 1
        self.control.record(len(drafts), accepted)
        self.proposed += len(drafts)
        self.accepted += accepted
        self.rounds += 1
        return Round([queued.token, *drafts[:accepted]], choice[accepted], len(drafts))

    def cut(self, queued: Queued, keep: int) -> None:
        """Keep the first *keep* tokens *queued* fed; the rest, and any round
        queued behind it, leave."""
        self.runner.accept(self.session, queued.position, keep, queued.held)

    def commit(self, position: int, keep: int) -> None:
        """Keep the first *keep* tokens the round fed at *position*; the
        rest leave."""
        self.runner.accept(self.session, position, keep)


def settle(
    tokens: Sequence[int], stop_ids: frozenset[int], remaining: int | None
) -> tuple[int, int]:
    """``(emit, keep)`` for a round's tokens: how many the reply takes, and how
    many stay fed. A stop id ends the reply unfed (it is ``tokens[emit]``); the
    reply's last token (``remaining`` reached) is emitted but not fed, as
    without drafts."""
    for j, token in enumerate(tokens):
        if token in stop_ids:
            return j, j
        if remaining is not None and j + 1 >= remaining:
            return j + 1, j
    return len(tokens), len(tokens)


def speculation_for(
    runner: Runner,
    sampler: Sampler,
    prompt: Sequence[int],
    generated: list[int],
    *,
    enabled: bool = True,
    drafter: Drafter | None = None,
    session: Session | None = None,
) -> Speculation | None:
    """A request's :class:`Speculation`, or None when it decodes one token per
    step: drafts are off (the runner's policy, or the request opted out with
    *enabled* False), or the sampler has logits processors or keeps logprobs.
    *drafter* overrides the runner's policy (the benchmark's oracles)."""
    if not enabled or sampler.stepwise:
        return None
    if drafter is not None:
        check_rollback(runner.family, type(drafter).__name__)
    else:
        policy = runner.draft
        if not policy.enabled:
            return None
        if policy.mode == "mtp":
            assert runner.mtp_head is not None  # Runner.open refuses mtp without one
            drafter = MtpDrafter(
                runner.mtp_head, lambda: runner.mtp_track(session), sampler, policy.max_draft
            )
        else:
            drafter = drafter_for(policy.mode, policy.max_draft, policy.min_match)
    return Speculation(runner, sampler, drafter, prompt, generated, session)
