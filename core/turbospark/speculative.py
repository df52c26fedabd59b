"""Speculative decoding: verify a round of drafts in one forward, keep what the target agrees with.

A round, for a confirmed token ``t`` (sampled, not yet fed) at ``position``:

1. the drafter (:mod:`turbospark.draft`) proposes ``d_1 .. d_k`` after ``t``;
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
it to 1 and pauses drafting for 1, 2, 4, 8 ... steps (plain pipelined decode)
before the next depth-1 probe, doubling without a bound until a draft passes,
so a hopeless drafter is probed O(log N) times in N tokens (a drafter without
blind probes, below, whose probes wait, and the MTP head, whose probes run
the head: 1, 4, 16 ... steps). A drafter that
proposes nothing pauses at most 8 steps: its probe is a lookup, no verify.

Blind probes (:meth:`Speculation.probe`): until a drafter has been right (an
MTP head gets one real round first), and again after every round with nothing
accepted, the generation loop does not
run a round (which waits for the confirmed token, then for the verify pass)
but a plain pipelined step whose forward also carries drafts after the
still-lazy token (:meth:`Drafter.propose_ahead`; the MTP head drafts one from
that token itself, still lazy, :meth:`MtpDrafter.probe_after
<turbospark.mtp.MtpDrafter.probe_after>`). Only that token is kept; the
next is sampled from the pass's first row, as a plain step would; the drafts'
fate is read one step later, with the next token, and only sets the depth. So
a hopeless drafter costs no waits, only the verify pass's extra kernels once
per pause (the 5% target against ``off``), and a good one starts drafting one
step late. A probe always keeps exactly its unread token (or nothing, when that
is a stop), so its pass leaves the recurrent state after that token current
(:meth:`Runner.verify` with ``keep=1``) and the cut after it builds nothing.
The engine's solo rows probe and draft the same way, one row at a time.

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

A request drafts only when it decodes alone through the one-row forward (the
generation loop; the engine's solo rows) and samples without logits
processors or logprobs (those see every sampled token one at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from turbospark.draft import Draft, Drafter, drafter_for
from turbospark.mtp import MtpDrafter
from turbospark.pool import Session
from turbospark.runner import Runner, check_rollback
from turbospark.sampling import Sampler

# The most plain steps between lookups of a drafter that keeps proposing nothing:
# such a probe costs only a lookup (no verify), and prompt lookup finds matches in
# bursts. Probes that verify something back off without a bound (DepthControl).
MAX_IDLE_PAUSE = 8
BLIND_BACKOFF = 2  # a missed blind probe's pause grows by this: it costs a few kernels
# A drafter whose probes wait (no blind probes) backs off faster: a waiting probe
# costs a lost overlap, about a step; so does an MTP head's blind probe, which runs
# the head (catch-up and one step) besides the verify pass's extra kernels.
WAITING_BACKOFF = 4


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
    waits: bool = False  # its probes wait for the confirmed token (no blind probes)
    growth: int = 0  # how much each miss lengthens the next pause (0: by waits)
    blind: bool = True  # nothing accepted yet (or since the last miss): probe blind
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
        self.blind = accepted == 0
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
            self.backoff *= self.growth or (WAITING_BACKOFF if self.waits else BLIND_BACKOFF)
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
    probed: int = 0  # drafts blind probes verified (not emitted; see probe())
    # A blind probe in flight: the target's choice after each of its drafts, and them
    # (an MTP probe's draft still lazy).
    _probe: tuple[mx.array, list[int] | list[mx.array]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        blind = self.drafter.guesses_ahead or self._mtp is not None
        # A checkpoint's MTP head was trained to be right: its first round is a real
        # one (it waits); only after a miss does it earn rounds back through probes.
        self.control = DepthControl(
            self.drafter.max_depth,
            waits=not blind,
            blind=self._mtp is None,
            growth=WAITING_BACKOFF if self._mtp is not None else 0,
        )

    @property
    def _mtp(self) -> MtpDrafter | None:
        """The MTP drafter, which probes blind from the unread id itself
        (:meth:`MtpDrafter.probe_after`) though it cannot guess ahead as ids."""
        return self.drafter if isinstance(self.drafter, MtpDrafter) else None

    @property
    def blind(self) -> bool:
        """Whether the next drafted step should be a blind :meth:`probe` (nothing
        accepted yet, or since the last miss) rather than a :meth:`round`."""
        return self.control.blind and not self.control.waits

    @property
    def probing(self) -> bool:
        """A probe's outcome is not read yet: the step after it is plain (reading
        it earlier would wait for the probe's forward)."""
        return self._probe is not None

    def probe(self, pending: mx.array, position: int, depth: int) -> mx.array | None:
        """A blind round, which costs no wait: verify drafts after the still-lazy
        *pending* token (:meth:`Drafter.propose_ahead`), queued as a plain step
        is, before *pending* is read. Only *pending* is kept (:meth:`cut` with 1
        once it is read and not a stop); the next token is sampled from the
        pass's first row, as a plain step samples it, and returned (lazy). The
        drafts' fate is read with that token (:meth:`settle_probe`) and only
        sets the depth: a drafter that keeps failing costs the verify pass's
        extra kernels every probe, not a wait and a lost overlap. None: the
        drafter had nothing to propose (the caller takes a plain step)."""
        fed = [*self.prompt, *self.generated]
        drafts: list[int] | list[mx.array]
        if self._mtp is not None:  # one lazy draft after the unread id: depth 1
            lazy = self._mtp.probe_after(fed, pending)
            drafts = [] if lazy is None else [lazy]
        else:
            drafts = self.drafter.propose_ahead(fed, depth).tokens[:depth]
        if not drafts:
            self.control.record(0, 0)
            return None

        def sample_and_choose(logits: mx.array) -> tuple[mx.array, mx.array]:
            choice = mx.argmax(logits[: len(drafts)], axis=-1)  # (k,): the target after each
            return self.sampler(logits[0]), choice

        # keep=1: only the unread token ever stays, so its state is made current now.
        following, choice = self.runner.verify(
            self.session, [pending, *drafts], position, then=sample_and_choose, keep=1
        )
        self._probe = (choice, drafts)
        self.probed += len(drafts)
        return following

    def settle_probe(self) -> None:
        """Read the last probe's outcome (computed with the token it sampled, which
        the caller has read) and set the depth from it."""
        if self._probe is None:
            return
        (choice, drafts), self._probe = self._probe, None
        target = choice.tolist()
        drafts = [d if isinstance(d, int) else int(d.item()) for d in drafts]
        passed = 0
        while passed < len(drafts) and drafts[passed] == target[passed]:
            passed += 1
        self.control.record(len(drafts), passed)

    def drop_probe(self) -> None:
        """Forget a probe whose confirmed token turned out a stop (it is undone)."""
        self._probe = None

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
        """Keep the first *keep* tokens the round (or probe) fed at *position*; the
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
