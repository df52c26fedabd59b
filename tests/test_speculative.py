"""Speculative decoding: policies refused by name, greedy output identical to
``off`` whatever the drafts, rollback without a trace, sampled speculation
unbiased, adaptive depth, and the engine's solo rows drafting."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import memory_in_use
from turbospark.contract.hookspecs import FamilySpec, hookimpl
from turbospark.errors import InvalidInput
from turbospark.generation.drafters import Draft, NgramDrafter, ReplayDrafter
from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import GenerationConfig, generate, stream_generate
from turbospark.generation.runner import Runner
from turbospark.generation.sampling import Sampler, SamplingParams
from turbospark.generation.speculation import (
    MAX_IDLE_PAUSE,
    MTP_BACKOFF,
    DepthControl,
    Speculation,
    accept_sampled,
)
from turbospark.loading.plugins import FamilyRegistry
from turbospark.policies import DraftPolicies
from turbospark.text import load_text

FAMILIES = ["gemma4", "qwen_gdn", "qwen4_exp"]
PROMPT = [*range(3, 30), *range(3, 15)]  # a repeat, so prompt lookup finds matches
CONFIG = GenerationConfig(max_tokens=24, stop_token_ids=[])
PROMPT_ROOM = 64  # context beyond a reply: the prompt and a round's drafts


def open_runner(path: Path, **kwargs: Any) -> Runner:
    return Runner.open(path, context_length=256, dtype="float32", **kwargs)


@pytest.fixture(params=FAMILIES)
def install(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_install")


# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda: DraftPolicies.ngram(max_draft=0), "max_draft=0"),
        (lambda: DraftPolicies.ngram(max_draft=-2), "max_draft=-2"),
        (lambda: DraftPolicies.ngram(min_match=0), "min_match=0"),
        (lambda: DraftPolicies.mtp(depth=0), "depth=0"),
        (lambda: DraftPolicies(mode="mtp", max_draft=0), "depth of 0"),
        (lambda: DraftPolicies.named("eagle"), "'eagle'"),
        (lambda: ReplayDrafter([1], 8, max_depth=0), "max_depth=0"),
    ],
)
def test_a_depth_below_one_or_an_unknown_policy_is_refused_by_name(make, named):
    with pytest.raises(InvalidInput, match=named.replace("(", r"\(")):
        make()


class _Frozen:
    """qwen_gdn, except that its recurrent state cannot be traced."""

    def __init__(self, base: Any) -> None:
        self.base = base

    @hookimpl
    def turbospark_family(self) -> FamilySpec:
        spec = self.base.turbospark_family()
        frozen = [c.model_copy(update={"traceable": False}) for c in spec.components]
        return spec.model_copy(update={"components": frozen})


def test_a_family_that_cannot_roll_back_is_refused_by_name(qwen_gdn_install):
    from turbospark_qwen_gdn import plugin

    registry = FamilyRegistry()
    registry.register(_Frozen(plugin), "qwen_gdn")
    with pytest.raises(InvalidInput, match=r"family 'qwen_gdn'.*gdn can neither rewind nor trace"):
        Runner.open(qwen_gdn_install, draft=DraftPolicies.ngram(), registry=registry)
    # Off stays possible with the same family.
    Runner.open(qwen_gdn_install, registry=registry)


# -- greedy: identical to off --------------------------------------------------------


def off_completion(path: Path, prompt: list[int], config: GenerationConfig = CONFIG):
    return generate(open_runner(path), load_text(path), prompt, config)


@pytest.mark.parametrize("accuracy", [1.0, 0.5, 0.0])
def test_greedy_output_with_any_drafter_equals_off(install, accuracy):
    off = off_completion(install, PROMPT)
    runner = open_runner(install)
    drafter = ReplayDrafter([*PROMPT, *off.tokens], runner.vocab_size, 4, accuracy, seed=3)
    drafted = generate(runner, load_text(install), PROMPT, CONFIG, drafter=drafter)
    assert drafted.tokens == off.tokens
    assert drafted.finish_reason == off.finish_reason
    assert drafted.stats.draft_proposed + drafted.stats.draft_probed > 0
    if accuracy == 1.0:
        assert drafted.stats.draft_accepted == drafted.stats.draft_proposed
    if accuracy == 0.0:
        assert drafted.stats.draft_accepted == 0
    # The session ends where off's does: no rejected (or unemitted) token stays fed.
    assert runner.sessions()[0].record.tokens == [*PROMPT, *off.tokens[:-1]]


def test_greedy_output_with_prompt_lookup_equals_off(install):
    off = off_completion(install, PROMPT)
    runner = open_runner(install, draft=DraftPolicies.ngram(max_draft=3, min_match=1))
    drafted = generate(runner, load_text(install), PROMPT, CONFIG)
    assert drafted.tokens == off.tokens
    assert drafted.stats.draft_accepted <= drafted.stats.draft_proposed


def test_a_request_can_opt_out_of_the_policy(qwen_gdn_install):
    runner = open_runner(qwen_gdn_install, draft=DraftPolicies.ngram(min_match=1))
    config = CONFIG.model_copy(update={"draft": False})
    done = generate(runner, load_text(qwen_gdn_install), PROMPT, config)
    assert done.stats.draft_proposed == 0


def test_stops_and_limits_inside_a_drafted_round_end_where_off_does(install):
    qwen_gdn_install = install  # every family: chained rounds cut their rings and traces
    off = off_completion(qwen_gdn_install, PROMPT)
    stop = off.tokens[7]  # lands inside a round of depth 4
    for config in (
        CONFIG.model_copy(update={"stop_token_ids": [stop]}),
        CONFIG.model_copy(update={"max_tokens": 6}),
        CONFIG.model_copy(update={"max_tokens": 1}),
    ):
        plain = off_completion(qwen_gdn_install, PROMPT, config)
        runner = open_runner(qwen_gdn_install)
        drafter = ReplayDrafter([*PROMPT, *off.tokens], runner.vocab_size, 4)
        drafted = generate(runner, load_text(qwen_gdn_install), PROMPT, config, drafter=drafter)
        assert (drafted.tokens, drafted.finish_reason) == (plain.tokens, plain.finish_reason)
        fed = plain.tokens if plain.finish_reason == "stop" else plain.tokens[:-1]
        assert runner.sessions()[0].record.tokens == [*PROMPT, *fed]


def _decode_forwards(monkeypatch: pytest.MonkeyPatch, after: int) -> list[int]:
    """The number of tokens of every forward fed at or past *after* (the decode
    steps once the prompt is in), through the one feeding path every forward
    takes (a plain step, a verify pass)."""
    lengths: list[int] = []
    feed = Runner._feed

    def counting_feed(self, tokens, start, *args, **kwargs):
        if start >= after:
            lengths.append(len(tokens))
        return feed(self, tokens, start, *args, **kwargs)

    monkeypatch.setattr(Runner, "_feed", counting_feed)
    return lengths


def test_shadow_probes_of_a_hopeless_drafter_verify_nothing_and_end_where_off_does(
    install, monkeypatch
):
    """A drafter that is never right only ever gets shadow probes (its guess
    compared with a plain step's token): no forward feeds more than one token,
    nothing is proposed for output, the reply and the session's record equal
    off's, also when the reply ends at a stop id (the first, here, and a later
    one)."""
    off = off_completion(install, PROMPT)
    for config in (
        CONFIG,
        CONFIG.model_copy(update={"stop_token_ids": [off.tokens[0]]}),
        CONFIG.model_copy(update={"stop_token_ids": [off.tokens[9]]}),
    ):
        plain = off_completion(install, PROMPT, config)
        runner = open_runner(install)
        drafter = ReplayDrafter([*PROMPT, *off.tokens], runner.vocab_size, 4, accuracy=0.0)
        forwards = _decode_forwards(monkeypatch, after=len(PROMPT))
        drafted = generate(runner, load_text(install), PROMPT, config, drafter=drafter)
        monkeypatch.undo()
        assert (drafted.tokens, drafted.finish_reason) == (plain.tokens, plain.finish_reason)
        assert drafted.stats.draft_proposed == 0
        assert drafted.stats.draft_probed > 0 or not drafted.tokens  # a stop at once: none
        assert forwards and set(forwards) == {1}
        fed = plain.tokens if plain.finish_reason == "stop" else plain.tokens[:-1]
        assert runner.sessions()[0].record.tokens == [*PROMPT, *fed]


class _RightFrom:
    """Proposes the recorded greedy reply, wrong for every token before reply
    index *right_from* and right from there on."""

    def __init__(self, prompt: list[int], reply: list[int], vocab: int, right_from: int) -> None:
        self.reference, self.vocab, self.cut = [*prompt, *reply], vocab, len(prompt) + right_from
        self.max_depth, self.guesses_ahead = 4, False
        self.asked: list[int] = []  # the position of the first token of every proposal

    def propose(self, context, depth):
        start = len(context)
        self.asked.append(start)
        truth = self.reference[start : start + depth]
        return Draft(
            [t if i >= self.cut else (t + 1) % self.vocab for i, t in enumerate(truth, start)]
        )

    def propose_ahead(self, context, depth):
        return Draft([])


@pytest.mark.parametrize("right_from", [0, 5, 40, 90])
def test_a_drafter_that_turns_right_after_a_hopeless_stretch_drafts_again_soon(
    qwen_gdn_install, monkeypatch, right_from
):
    """However long the hopeless stretch, shadow probes pause at most
    MAX_IDLE_PAUSE steps, so the first verify pass comes within MAX_IDLE_PAUSE
    + 2 tokens of the drafter turning right (the probe's guess is read one step
    after it is made, the round follows); none comes before; greedy output
    equals off's."""
    config = CONFIG.model_copy(update={"max_tokens": 128})
    off = off_completion(qwen_gdn_install, PROMPT, config)
    runner = Runner.open(qwen_gdn_install, context_length=PROMPT_ROOM + 128, dtype="float32")
    drafter = _RightFrom(PROMPT, off.tokens, runner.vocab_size, right_from)
    verified: list[int] = []
    verify = Runner.verify

    def spying_verify(self, session, tokens, start, *args, **kwargs):
        verified.append(start - len(PROMPT))  # the reply index of the token it confirms
        return verify(self, session, tokens, start, *args, **kwargs)

    monkeypatch.setattr(Runner, "verify", spying_verify)
    done = generate(runner, load_text(qwen_gdn_install), PROMPT, config, drafter=drafter)
    assert done.tokens == off.tokens
    assert verified and right_from < verified[0] <= right_from + MAX_IDLE_PAUSE + 2
    assert done.stats.draft_accepted > 0
    assert runner.sessions()[0].record.tokens == [*PROMPT, *off.tokens[:-1]]


def test_a_sampled_reply_with_shadow_probes_equals_off_by_seed(qwen_gdn_install):
    """At temperature > 0 a shadow probe's step samples with its own key, as a
    plain step does (the probe draws nothing): a drafter that is never right
    leaves the seeded sampled reply exactly what off gives."""
    config = CONFIG.model_copy(update={"temperature": 0.8, "top_k": 8, "seed": 3})
    off = off_completion(qwen_gdn_install, PROMPT, config)
    runner = open_runner(qwen_gdn_install)
    drafter = ReplayDrafter([*PROMPT, *off.tokens], runner.vocab_size, 4, accuracy=0.0)
    done = generate(runner, load_text(qwen_gdn_install), PROMPT, config, drafter=drafter)
    assert done.stats.draft_probed > 0 and done.stats.draft_proposed == 0
    assert done.tokens == off.tokens
    assert runner.sessions()[0].record.tokens == [*PROMPT, *off.tokens[:-1]]


def test_chained_rounds_cut_inside_a_round_read_short(install, monkeypatch):
    """At 90% some rounds pass whole (the next is chained behind them) and some
    chained ones are read short and cut back through their held traces; the
    reply and the session still equal off's."""
    chained, cut_held = [], []
    launch_after, accept = Speculation.launch_after, Runner.accept

    def counting_launch_after(self, queued, remaining):
        after = launch_after(self, queued, remaining)
        chained.append(after is not None)
        return after

    def counting_accept(self, session, start, keep, held=None):
        cut_held.append(held is not None)
        return accept(self, session, start, keep, held)

    monkeypatch.setattr(Speculation, "launch_after", counting_launch_after)
    monkeypatch.setattr(Runner, "accept", counting_accept)
    config = CONFIG.model_copy(update={"max_tokens": 48})
    off = off_completion(install, PROMPT, config)
    runner = open_runner(install)
    drafter = ReplayDrafter([*PROMPT, *off.tokens], runner.vocab_size, 4, 0.9, seed=1)
    drafted = generate(runner, load_text(install), PROMPT, config, drafter=drafter)
    assert drafted.tokens == off.tokens
    assert runner.sessions()[0].record.tokens == [*PROMPT, *off.tokens[:-1]]
    assert any(chained) and any(cut_held)


def test_a_stream_closed_inside_chained_rounds_leaves_no_unread_round(install):
    """Greedy rounds that pass whole queue the next round before they are read;
    a consumer that stops iterating at any token leaves the session holding only
    tokens of the rounds it was given (a prefix of off's reply), never the
    round queued behind them."""
    off = off_completion(install, PROMPT)
    reference = [*PROMPT, *off.tokens]
    codec = load_text(install)
    for taken in range(1, 16):
        runner = open_runner(install)
        drafter = ReplayDrafter(reference, runner.vocab_size, 4, accuracy=0.9, seed=taken)
        chunks = stream_generate(runner, codec, PROMPT, CONFIG, drafter=drafter)
        for _ in range(taken):
            next(chunks)
        chunks.close()
        held = list(runner.sessions()[0].record.tokens)
        assert held == reference[: len(held)]
        assert len(PROMPT) + taken - 1 <= len(held) <= len(PROMPT) + taken + 4
        assert runner.position == len(held)
        nxt = runner.produce(reference[len(held)], len(held))
        fresh = open_runner(install)  # the same tokens, decoded one at a time
        fresh.prefill_chunk(PROMPT, 0)
        for position in range(len(PROMPT), len(held) + 1):
            expected = fresh.produce(reference[position], position)
        np.testing.assert_allclose(np.array(nxt), np.array(expected), atol=1e-4, rtol=1e-4)


# -- rollback leaves no trace --------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 1, 2, 4])
def test_after_a_rollback_the_next_logits_equal_a_fresh_run(install, keep):
    drafts = [5, 9, 17, 33]
    spec = open_runner(install)
    spec.prefill_chunk(PROMPT, 0)
    spec.verify(None, [7, *drafts], len(PROMPT))
    spec.accept(None, len(PROMPT), 1 + keep)  # the confirmed token and `keep` drafts stay
    kept = [7, *drafts][: 1 + keep]
    assert spec.position == len(PROMPT) + len(kept)
    after = spec.produce(40, spec.position)

    fresh = open_runner(install)
    fresh.prefill_chunk(PROMPT, 0)
    for i, token in enumerate(kept):
        fresh.produce(token, len(PROMPT) + i)
    expected = fresh.produce(40, fresh.position)
    np.testing.assert_allclose(np.array(after), np.array(expected), atol=1e-5, rtol=1e-5)
    assert spec.sessions()[0].record.tokens == fresh.sessions()[0].record.tokens


def test_a_round_cut_short_parks_its_session_without_the_pass_trace(qwen_gdn_install):
    """A cut inside a verify pass rebuilds the recurrent state from the pass's
    trace; left lazy, that state kept the whole trace alive (every token's
    deltas and decays: about ten times the session at 200 drafts), and a
    reply ending on the round parked it so. Parked, the session holds only
    its own bytes."""
    drafts = [5 + i % 90 for i in range(200)]
    runner = open_runner(qwen_gdn_install, session_slots=2)

    def cut_round() -> None:
        runner.prefill_chunk(PROMPT, 0)
        runner.verify(None, [7, *drafts], len(PROMPT))
        runner.accept(None, len(PROMPT), 3)
        runner.reset()  # parks it

    cut_round()  # the first builds what the process keeps (compiled steps, caches)
    runner.forget_sessions()
    before = memory_in_use()
    cut_round()
    held = sum(runner.session_nbytes())
    assert held > 0
    assert memory_in_use() - before <= 2 * held + (1 << 20)


def test_a_verify_pass_with_an_unread_draft_is_refused_before_any_state_changes(
    qwen_gdn_install,
):
    """Only the confirmed token may still be computing when a pass is queued;
    an unread draft after it is refused by name, and the session is untouched."""
    runner = open_runner(qwen_gdn_install)
    runner.prefill_chunk(PROMPT, 0)
    with pytest.raises(InvalidInput, match="only the first token fed may be a lazy"):
        runner.verify(None, [mx.array(7), mx.array([5])], len(PROMPT))
    assert runner.position == len(PROMPT)
    assert not runner.sessions()[0].state["gdn"].tracing


def test_a_hopeless_drafter_costs_lookups_only_end_to_end(qwen_gdn_install, monkeypatch):
    """Through the generation loop: greedy output equals off's token for token,
    every decode forward feeds one token (no verify pass at all), and the
    (depth-1) shadow probes come after pauses of 1, 2, 4, 8, 8 ... steps."""
    probed = {}
    for tokens in (16, 128):
        config = CONFIG.model_copy(update={"max_tokens": tokens})
        off = off_completion(qwen_gdn_install, PROMPT, config)
        runner = Runner.open(qwen_gdn_install, context_length=PROMPT_ROOM + tokens, dtype="float32")
        drafter = ReplayDrafter([*PROMPT, *off.tokens], runner.vocab_size, 4, accuracy=0.0)
        forwards = _decode_forwards(monkeypatch, after=len(PROMPT))
        done = generate(runner, load_text(qwen_gdn_install), PROMPT, config, drafter=drafter)
        monkeypatch.undo()
        assert done.tokens == off.tokens
        assert done.stats.draft_proposed == 0
        assert set(forwards) == {1} and len(forwards) == tokens - 1  # the last is never fed
        probed[tokens] = done.stats.draft_probed
    # probes guess after reply tokens 0, 3, 7, 13, 23, 33 ... 123 (each read a step later)
    assert probed == {16: 4, 128: 15}


def test_a_drafted_reply_resumes_from_its_prompt_checkpoint_next_turn(qwen_gdn_install):
    """The second turn of a GDN chat (reuse through the prompt-boundary
    checkpoint) is the same whether the first reply was drafted or not."""
    codec = load_text(qwen_gdn_install)
    config = CONFIG.model_copy(update={"max_tokens": 10})
    outputs = []
    for draft in (DraftPolicies.off(), DraftPolicies.ngram(min_match=1)):
        runner = open_runner(qwen_gdn_install, draft=draft, session_slots=2)
        runner.set_prefix_reuse(True)
        first = generate(runner, codec, PROMPT, config)
        second = generate(runner, codec, [*PROMPT, 50, 51, 52], config)
        outputs.append((first.tokens, second.tokens, second.stats.reused_tokens))
    assert outputs[0] == outputs[1]
    assert outputs[0][2] > 0


# -- sampling stays unbiased ----------------------------------------------------------


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    seen = expected > 0
    assert counts[~seen].sum() == 0, "a token the target cannot sample was emitted"
    return float((((counts - expected) ** 2)[seen] / expected[seen]).sum())


def test_a_sampled_shadow_hit_is_as_likely_as_a_depth_one_rounds_acceptance():
    """With sampling, a point-mass draft passes a depth-1 round with probability
    p(draft), and the plain step's sampled token equals it with the same
    probability: a shadow probe's hit rate estimates the round's acceptance
    without bias (here both within 4 standard errors of p(draft))."""
    logits = mx.array([[2.0, 1.2, 0.5, -1.0, 0.1], [0.0] * 5])  # (k + 1, vocab), k = 1
    params = SamplingParams(temperature=0.8, seed=3)
    p = float(mx.softmax(Sampler(params).warp(logits[0]))[1])  # the draft's target prob
    trials = 3000
    sampler = Sampler(params)
    accepted = sum(accept_sampled(logits, Draft([1]), sampler)[0] for _ in range(trials))
    hits = sum(int(sampler(logits[0]).item()) == 1 for _ in range(trials))
    bound = 4 * np.sqrt(p * (1 - p) / trials)
    assert abs(accepted / trials - p) < bound and abs(hits / trials - p) < bound


@pytest.mark.parametrize("drafted_probs", [False, True])
def test_sampled_speculation_matches_the_target_distribution(qwen_gdn_install, drafted_probs):
    """The first token after the confirmed one, over many seeded rounds: with an
    adversarial drafter (it proposes the target's *least* likely kept token, or
    samples from a skewed q) its distribution is still the target's."""
    runner = open_runner(qwen_gdn_install)
    runner.prefill_chunk(PROMPT, 0)
    params = SamplingParams(temperature=1.0, top_k=6, seed=11)
    logits = runner.verify(None, [7, 0, 0], len(PROMPT))  # only the rows' logits matter here
    target = np.array(mx.softmax(Sampler(params).warp(logits[0])))
    kept = np.flatnonzero(target)
    worst = int(kept[np.argmin(target[kept])])
    q = np.zeros_like(target)
    q[kept] = np.linspace(1, 30, len(kept))
    q[worst] = 60.0
    q /= q.sum()  # a skewed draft distribution over the kept tokens
    sampler = Sampler(params)
    rng = np.random.default_rng(5)
    counts = np.zeros_like(target)
    trials = 1500
    for _ in range(trials):
        if drafted_probs:
            first = int(rng.choice(len(q), p=q))
            probs = mx.array(np.stack([q, q]).astype(np.float32))
        else:
            first, probs = worst, None
        accepted, following = accept_sampled(logits, Draft([first, worst], probs), sampler)
        counts[first if accepted >= 1 else following] += 1
    # 5 degrees of freedom: the 0.1% critical value is 20.5.
    assert _chi_square(counts, target) < 20.5
    direct = np.bincount(rng.choice(len(target), size=trials, p=target), minlength=len(target))
    assert _chi_square(direct.astype(float), target) < 20.5  # the same test passes for p itself


# -- adaptive depth -------------------------------------------------------------------


def _probes(control: DepthControl, steps: int, passed: int = 0) -> list[tuple[int, int]]:
    """``(step, depth)`` of every probe a drafter whose drafts never pass (or whose
    first *passed* probes pass whole) gets in *steps* steps."""
    probes = []
    for step in range(steps):
        depth = control.next_depth()
        if depth:
            probes.append((step, depth))
            control.record(depth, depth if len(probes) <= passed else 0)
    return probes


def test_a_hopeless_lookup_drafter_is_probed_every_few_steps():
    """A lookup drafter's probes are shadow probes (no device work), so their
    pauses stop growing at MAX_IDLE_PAUSE: a drafter that turns right is found
    within a bounded number of steps, however long it was hopeless."""
    at = [step for step, _ in _probes(DepthControl(max_depth=4), 200)]
    assert at[:7] == [0, 2, 5, 10, 19, 28, 37]
    assert {b - a for a, b in itertools.pairwise(at[4:])} == {MAX_IDLE_PAUSE + 1}


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=60))
def test_a_lookup_drafters_pause_never_outgrows_the_cap(outcomes):
    """Whatever rounds and probes a lookup drafter has seen (proposed, accepted),
    its next pause is at most MAX_IDLE_PAUSE plain steps: the bound on how late
    it resumes once right."""
    control = DepthControl(max_depth=4)
    for proposed, accepted in outcomes:
        control.record(proposed, min(accepted, proposed))
        assert control.pause <= MAX_IDLE_PAUSE and control.backoff <= MAX_IDLE_PAUSE
        assert 1 <= control.depth <= 4


def test_a_hopeless_mtp_head_is_probed_a_logarithmic_number_of_times():
    """The MTP head's probes run the head, so their pauses grow 4x without a
    bound: over N tokens a head that is never right is probed O(log N) times."""
    for steps in (100, 1_000, 100_000):
        probes = _probes(DepthControl(max_depth=4, growth=MTP_BACKOFF, cap=None), steps)
        assert {depth for _, depth in probes} == {1}
        assert len(probes) <= np.log(steps) / np.log(MTP_BACKOFF) + 2
    at = [step for step, _ in _probes(DepthControl(max_depth=4, growth=MTP_BACKOFF, cap=None), 200)]
    assert at[:5] == [0, 2, 7, 24, 89]


def test_a_drafter_that_misses_after_passing_probes_again_at_depth_one():
    """A miss after rounds that passed drops to depth 1 and the shortest pause
    (the back-off starts again once a draft passes)."""
    probes = _probes(DepthControl(max_depth=4), 10, passed=3)
    assert probes == [(0, 1), (1, 2), (2, 4), (3, 4), (5, 1), (8, 1)]


def test_a_perfect_drafter_reaches_full_depth_and_stays():
    control = DepthControl(max_depth=5)
    depths = []
    for _ in range(20):
        depths.append(control.next_depth())
        control.record(depths[-1], depths[-1])
    assert depths == [1, 2, 4] + [5] * 17


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(max_draft=3, min_match=2)
    context = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2]
    assert drafter.propose(context, 3).tokens == [3, 5, 6]
    assert drafter.propose([*context, 3], 3).tokens == [5, 6, 1]  # longer match, same place
    assert drafter.propose([*context, 3, 7], 3).tokens == []


# -- the engine's solo rows -------------------------------------------------------------


class Collector:
    def __init__(self) -> None:
        self.chunks: list = []

    def __call__(self, item) -> None:
        if isinstance(item, Exception):
            raise item
        self.chunks.append(item)


def test_an_engine_row_decoding_alone_drafts_and_equals_off(install):
    off = off_completion(install, PROMPT)
    runner = open_runner(install)
    engine = Engine(runner, load_text(install))
    drafter = ReplayDrafter([*PROMPT, *off.tokens], runner.vocab_size, 4, 0.75, seed=2)
    emit = Collector()
    engine.submit(Job(ids=list(PROMPT), config=CONFIG, emit=emit, drafter=drafter))
    for _ in range(200):
        if emit.chunks and emit.chunks[-1].finish_reason is not None:
            break
        engine.step()
    tokens = [c.token for c in emit.chunks if c.token is not None]
    assert tokens == off.tokens
    stats = emit.chunks[-1].stats
    assert 0 < stats.draft_accepted < stats.draft_proposed
    assert runner.sessions()[0].record.tokens == [*PROMPT, *off.tokens[:-1]]


def _engine_reply(
    path: Path, config: GenerationConfig, reply: list[int], drafter: Any = None
) -> tuple[Runner, list]:
    """An engine row decoding alone with *drafter* (default: one that is never
    right about *reply*)."""
    runner = Runner.open(path, context_length=PROMPT_ROOM + 128, dtype="float32")
    engine = Engine(runner, load_text(path))
    emit = Collector()
    if drafter is None:
        drafter = ReplayDrafter([*PROMPT, *reply], runner.vocab_size, 4, accuracy=0.0)
    engine.submit(Job(ids=list(PROMPT), config=config, emit=emit, drafter=drafter))
    for _ in range(400):
        if emit.chunks and emit.chunks[-1].finish_reason is not None:
            break
        engine.step()
    return runner, emit.chunks


@pytest.mark.parametrize("stop_at", [None, 0, 3, 4, 7])
def test_an_engine_row_shadow_probes_a_hopeless_drafter_and_ends_where_off_does(
    qwen_gdn_install, monkeypatch, stop_at
):
    """An engine row decoding alone probes in the shadow, as the generation loop
    does (guesses after ids 0, 3, 7 and 13 of this reply): nothing is proposed
    for output, no forward feeds more than one token, and a reply that ends at
    a stop id leaves nothing after it fed."""
    off = off_completion(qwen_gdn_install, PROMPT)
    stop = [] if stop_at is None else [off.tokens[stop_at]]
    config = CONFIG.model_copy(update={"stop_token_ids": stop})
    plain = off_completion(qwen_gdn_install, PROMPT, config)
    forwards = _decode_forwards(monkeypatch, after=len(PROMPT))
    runner, chunks = _engine_reply(qwen_gdn_install, config, off.tokens)
    assert [c.token for c in chunks if c.token is not None] == plain.tokens
    assert chunks[-1].finish_reason == plain.finish_reason
    stats = chunks[-1].stats
    assert stats.draft_proposed == 0
    assert set(forwards) <= {1}
    if stop_at is None:
        assert stats.draft_probed == 4  # 24 tokens
    fed = plain.tokens if plain.finish_reason == "stop" else plain.tokens[:-1]
    assert runner.sessions()[0].record.tokens == [*PROMPT, *fed]


def test_an_engine_row_whose_drafter_turns_right_drafts_again_soon(qwen_gdn_install, monkeypatch):
    """The engine's solo row resumes drafting as the generation loop does: the
    first verify pass within MAX_IDLE_PAUSE + 2 tokens of the drafter turning
    right, the reply equal to off's."""
    config = CONFIG.model_copy(update={"max_tokens": 96})
    off = off_completion(qwen_gdn_install, PROMPT, config)
    vocab = open_runner(qwen_gdn_install).vocab_size
    drafter = _RightFrom(PROMPT, off.tokens, vocab, right_from=50)
    verified: list[int] = []
    verify = Runner.verify

    def spying_verify(self, session, tokens, start, *args, **kwargs):
        verified.append(start - len(PROMPT))
        return verify(self, session, tokens, start, *args, **kwargs)

    monkeypatch.setattr(Runner, "verify", spying_verify)
    _, chunks = _engine_reply(qwen_gdn_install, config, off.tokens, drafter)
    assert [c.token for c in chunks if c.token is not None] == off.tokens
    assert verified and 50 < verified[0] <= 50 + MAX_IDLE_PAUSE + 2
    assert chunks[-1].stats.draft_accepted > 0


# -- the server and the CLI ---------------------------------------------------------------


def test_the_server_reports_drafts_and_takes_a_per_request_opt_out(gemma4_install):
    import openai
    from serving import client, serving

    codec = load_text(gemma4_install)
    with serving(gemma4_install, codec, 1, draft=DraftPolicies.ngram(min_match=1)) as server:
        api = client(server)
        ask = {
            "model": "tiny-gemma4-session-pool",
            "prompt": "abc abc abc abc",
            "max_tokens": 24,
            "temperature": 0,
        }
        drafted = api.completions.create(**ask, extra_body={"ignore_eos": True})
        plain = api.completions.create(**ask, extra_body={"ignore_eos": True, "draft": "off"})
        assert drafted.choices[0].text == plain.choices[0].text
        assert plain.usage.turbospark["draft_proposed"] == 0
        assert plain.usage.turbospark["draft_probed"] == 0
        usage = drafted.usage.turbospark
        assert usage["draft_proposed"] >= usage["draft_accepted"] >= 0
        assert usage["draft_probed"] > 0  # a drafter starts with a shadow probe
        with pytest.raises(openai.BadRequestError, match="draft"):
            api.completions.create(**ask, extra_body={"draft": "maybe"})


def test_generate_json_reports_draft_counts_and_refuses_a_bad_depth(qwen_gdn_install, capsys):
    import json

    from turbospark.cli import main

    argv = ["generate", str(qwen_gdn_install), "--prompt", "abcabcabc", "--raw", "--json"]
    assert main([*argv, "--max-tokens", "8", "--draft", "ngram", "--draft-depth", "3"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["draft_proposed"] >= stats["draft_accepted"] >= 0
    assert main([*argv, "--draft", "ngram", "--draft-depth", "0"]) != 0
    assert "max_draft=0" in capsys.readouterr().err
    assert main([*argv, "--draft", "mtp"]) != 0
    assert "no mtp.* weights" in capsys.readouterr().err


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(
    accuracy=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    depth=st.integers(1, 6),
    max_tokens=st.integers(1, 20),
    stop_at=st.one_of(st.none(), st.integers(0, 19)),
    seed=st.integers(0, 3),
)
def test_any_drafting_schedule_ends_exactly_where_off_does(
    qwen_gdn_install, accuracy, depth, max_tokens, stop_at, seed
):
    """Whatever the drafter's depth and luck, the limit and the stop id: the reply,
    its finish reason and the session it leaves are those of decoding without drafts."""
    off = _off_reply(qwen_gdn_install)
    stop = None if stop_at is None else off[stop_at]
    expected, finish = off[:max_tokens], "length"
    if stop is not None and stop in expected:
        expected, finish = expected[: expected.index(stop)], "stop"
    config = CONFIG.model_copy(
        update={"max_tokens": max_tokens, "stop_token_ids": [] if stop is None else [stop]}
    )
    runner = open_runner(qwen_gdn_install)
    drafter = ReplayDrafter([*PROMPT, *off], runner.vocab_size, depth, accuracy, seed=seed)
    done = generate(runner, load_text(qwen_gdn_install), PROMPT, config, drafter=drafter)
    assert (done.tokens, done.finish_reason) == (expected, finish)
    fed = expected if finish == "stop" else expected[:-1]
    assert runner.sessions()[0].record.tokens == [*PROMPT, *fed]


_OFF: dict[Path, list[int]] = {}


def _off_reply(path: Path) -> list[int]:
    if path not in _OFF:
        _OFF[path] = off_completion(
            path, PROMPT, CONFIG.model_copy(update={"max_tokens": 20})
        ).tokens
    return _OFF[path]


def test_a_drafter_with_nothing_to_propose_is_asked_again_soon():
    control = DepthControl(max_depth=4)
    asked = 0
    for _ in range(400):
        if control.next_depth():
            asked += 1
            control.record(0, 0)
    assert 400 / 9 <= asked < 400 / 8 + 5
