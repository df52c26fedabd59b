"""Continuous batching: requests decoded together equal the same requests run alone.

Every check compares two paths: the engine with several requests in flight
(batched forward, joins and leaves between steps, chunked prefill interleaved
with decode) against :func:`turbospark.generation.generate.generate` run one request at a
time on a fresh runner. Float32 on the CPU; temperature 0 unless said.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from helpers import memory_in_use
from turbospark import build_synthetic_install
from turbospark.errors import TurbosparkError
from turbospark.generation.engine import WARM_UP_ROUNDS, Engine, Job, _ragged_width
from turbospark.generation.generate import Chunk, GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.layers.fused import runs_compiled
from turbospark.state.kv import LayerKV
from turbospark.text import TextCodec, load_text

CONTEXT = 256


class Collector:
    """A job's chunks (or its error), as the server's bridge would receive them."""

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.error: Exception | None = None

    def __call__(self, item: Chunk | Exception) -> None:
        if isinstance(item, Exception):
            self.error = item
        else:
            self.chunks.append(item)

    @property
    def done(self) -> bool:
        return self.error is not None or bool(self.chunks and self.chunks[-1].finish_reason)

    @property
    def tokens(self) -> list[int]:
        return [c.token for c in self.chunks if c.token is not None]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)


def open_runner(install: Path, slots: int = 4) -> Runner:
    runner = Runner.open(install, context_length=CONTEXT, session_slots=slots)
    runner.set_prefix_reuse(True)
    return runner


def run_all(engine: Engine, jobs: list[tuple[int, Job]], limit: int = 2000) -> None:
    """Step the engine, submitting each job at its step number, until all are done."""
    pending = sorted(jobs, key=lambda j: j[0])
    for step in range(limit):
        while pending and pending[0][0] <= step:
            engine.submit(pending.pop(0)[1])
        engine.step()
        if not pending and all(job.emit.done for _, job in jobs):
            return
    raise AssertionError("the engine did not finish every job")


def assert_sessions_sound(runner: Runner) -> None:
    """Every session the engine left behind agrees with itself: each component at
    the record's length, and every rewind limit computable."""
    for state in runner.session_states():
        positions = {component.position for component in state.values()}
        assert len(positions) == 1, {n: c.position for n, c in state.items()}
        for component in state.values():
            assert component.max_safe_rewind >= 0
            for layer in getattr(component, "layers", []):
                if isinstance(layer, LayerKV) and layer.keys is not None:
                    assert layer.base + layer.fill == component.position


def alone(install: Path, codec: TextCodec, ids: list[int], config: GenerationConfig):
    return generate(Runner.open(install, context_length=CONTEXT), codec, ids, config)


PROMPTS = [
    [2, 5, 9, 14, 20, 31, 40],
    [2, 5, 9, 60, 61],
    [2, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87],
    [2, 5, 9, 14, 20, 31, 40, 41, 42, 43],
    [2, 90],
]


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn", "qwen4_exp"])
def test_requests_in_flight_together_equal_each_alone(family, request):
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install, slots=1 if family == "qwen4_exp" else 4)
    engine = Engine(runner, codec, max_batch=3, prefill_budget=4)
    configs = [
        GenerationConfig(max_tokens=n, temperature=0.0, stop_token_ids=[], chunk_size=3)
        for n in (12, 5, 9, 1, 7)
    ]
    jobs = [
        (at, Job(ids=list(p), config=c, emit=Collector()))
        for at, p, c in zip([0, 0, 1, 3, 4], PROMPTS, configs, strict=True)
    ]
    run_all(engine, jobs)
    assert engine.active_rows == 0 and engine.queue_depth == 0
    assert_sessions_sound(runner)
    peak = max(job.emit.chunks[-1].stats.batch_size for _, job in jobs)
    assert peak > 1, "no two requests ever decoded in one batch"
    for (_, job), prompt, config in zip(jobs, PROMPTS, configs, strict=True):
        assert job.emit.error is None, job.emit.error
        expected = alone(install, codec, prompt, config)
        assert job.emit.tokens == expected.tokens, (family, prompt)
        assert job.emit.chunks[-1].finish_reason == expected.finish_reason


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_sessions_left_by_batched_requests_resume_exactly(family, request):
    """Second turns reuse what the batch left behind and still equal fresh runs."""
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install, slots=4)
    engine = Engine(runner, codec, max_batch=4)
    config = GenerationConfig(max_tokens=6, temperature=0.0, stop_token_ids=[])
    firsts = [Job(ids=list(p), config=config, emit=Collector()) for p in PROMPTS[:3]]
    run_all(engine, [(0, job) for job in firsts])
    seconds = [
        Job(ids=[*job.ids, *job.emit.tokens[:-1], 3, 4], config=config, emit=Collector())
        for job in firsts
    ]
    run_all(engine, [(0, job) for job in seconds])
    for job in seconds:
        stats = job.emit.chunks[-1].stats
        assert stats.reused_tokens > 0, stats
        assert job.emit.tokens == alone(install, codec, job.ids, config).tokens


def test_stops_and_stop_strings_end_rows_mid_batch(gemma4_install):
    codec = load_text(gemma4_install)
    config = GenerationConfig(max_tokens=10, temperature=0.0, stop_token_ids=[])
    free = [alone(gemma4_install, codec, p, config).tokens for p in PROMPTS[:3]]
    # Each row stops on its own 4th token, or on the text of its 3rd.
    configs = [
        GenerationConfig(max_tokens=10, temperature=0.0, stop_token_ids=[free[0][3]]),
        GenerationConfig(
            max_tokens=10, temperature=0.0, stop_token_ids=[], stop=[codec.decode([free[1][2]])]
        ),
        config,
    ]
    engine = Engine(open_runner(gemma4_install), codec, max_batch=3)
    jobs = [
        Job(ids=list(p), config=c, emit=Collector())
        for p, c in zip(PROMPTS[:3], configs, strict=True)
    ]
    run_all(engine, [(0, job) for job in jobs])
    assert_sessions_sound(engine.runner)
    for job, prompt, c in zip(jobs, PROMPTS[:3], configs, strict=True):
        expected = alone(gemma4_install, codec, prompt, c)
        assert (job.emit.tokens, job.emit.text) == (expected.tokens, expected.text)
        assert job.emit.chunks[-1].finish_reason == expected.finish_reason


def test_a_cancelled_row_frees_its_place_and_the_others_finish(gemma4_install):
    codec = load_text(gemma4_install)
    engine = Engine(open_runner(gemma4_install), codec, max_batch=2)
    config = GenerationConfig(max_tokens=8, temperature=0.0, stop_token_ids=[])
    jobs = [Job(ids=list(p), config=config, emit=Collector()) for p in PROMPTS[:3]]
    for job in jobs:
        engine.submit(job)
    for _ in range(3):
        engine.step()
    jobs[0].cancelled.set()
    while engine.step():
        pass
    assert engine.active_rows == 0 and jobs[0].emit.chunks[-1].finish_reason == "stop"
    for job, prompt in zip(jobs[1:], PROMPTS[1:3], strict=True):
        assert job.emit.tokens == alone(gemma4_install, codec, prompt, config).tokens


def test_a_failing_row_fails_alone(gemma4_install, monkeypatch):
    """A plugin raising inside one batched step: the step is undone, rows retry
    alone, and only the row whose forward raises sees the error."""
    codec = load_text(gemma4_install)
    runner = open_runner(gemma4_install)
    engine = Engine(runner, codec, max_batch=3)
    config = GenerationConfig(max_tokens=6, temperature=0.0, stop_token_ids=[])
    poisoned = [2, 5, 9, 99, 100]
    real_batch, real_feed = runner.forward_batch, runner.feed
    calls = {"batch": 0}

    def flaky_batch(tokens, positions, state, steer=None):
        # Counts decode steps only (one token a row): prompts are prefilled
        # through the same forward, several at once.
        decode = tokens.shape[1] == 1
        calls["batch"] += decode
        if decode and calls["batch"] == 2:
            raise RuntimeError("a plugin failed")
        return real_batch(tokens, positions, state, steer)

    def poisoned_feed(session, tokens, start, logits=False, then=None):
        if session.record.tokens[:5] == poisoned and start > len(poisoned):
            raise RuntimeError("this row's plugin state is broken")
        return real_feed(session, tokens, start, logits, then)

    monkeypatch.setattr(runner, "forward_batch", flaky_batch)
    monkeypatch.setattr(runner, "feed", poisoned_feed)
    jobs = [Job(ids=list(p), config=config, emit=Collector()) for p in [*PROMPTS[:2], poisoned]]
    run_all(engine, [(0, job) for job in jobs])
    assert isinstance(jobs[2].emit.error, RuntimeError)
    for job, prompt in zip(jobs[:2], PROMPTS[:2], strict=True):
        assert job.emit.error is None
        assert job.emit.tokens == alone(gemma4_install, codec, prompt, config).tokens


def test_a_bad_request_is_refused_and_nothing_changes(gemma4_install):
    codec = load_text(gemma4_install)
    runner = open_runner(gemma4_install)
    engine = Engine(runner, codec)
    config = GenerationConfig(max_tokens=3, temperature=0.0)
    run_all(engine, [(0, Job(ids=list(PROMPTS[0]), config=config, emit=Collector()))])
    before = [list(s.values()) for s in runner.session_states()]
    bad = Job(ids=[2, 5, 10_000], config=config, emit=Collector())
    run_all(engine, [(0, bad)])
    assert isinstance(bad.emit.error, TurbosparkError)
    assert "vocabulary" in str(bad.emit.error)
    assert [list(s.values()) for s in runner.session_states()] == before


def test_a_row_reaching_the_context_length_ends_alone(gemma4_install):
    """One row runs into the context length mid-batch: it ends with "length"
    exactly where it would alone, and the rows beside it carry on."""
    codec = load_text(gemma4_install)
    runner = open_runner(gemma4_install)
    engine = Engine(runner, codec, max_batch=3)
    config = GenerationConfig(max_tokens=10, temperature=0.0, stop_token_ids=[])
    long_prompt = [2, *(3 + i % 100 for i in range(CONTEXT - 4))]  # room for 3 more tokens
    prompts = [PROMPTS[0], long_prompt, PROMPTS[1]]
    jobs = [Job(ids=list(p), config=config, emit=Collector()) for p in prompts]
    run_all(engine, [(0, job) for job in jobs])
    assert_sessions_sound(runner)
    for job, prompt in zip(jobs, prompts, strict=True):
        expected = alone(gemma4_install, codec, prompt, config)
        assert job.emit.tokens == expected.tokens
        assert job.emit.chunks[-1].finish_reason == expected.finish_reason
    assert len(jobs[1].emit.tokens) == 4 and jobs[1].emit.chunks[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("family", "ragged"),
    [("gemma4", True), ("qwen_gdn", True), ("qwen_gdn", False), ("qwen4_exp", False)],
)
def test_prompts_admitted_together_are_prefilled_in_one_forward(
    family, ragged, request, monkeypatch
):
    """Three fresh prompts of one length: one batched prefill forward takes all
    of them (last token included), and each row still equals its request alone;
    then three of different lengths, extending those sessions: where the batched
    state takes ragged rows (K/V shifts its rows, gated DeltaNet lets padding
    pass), one forward takes them all, the shorter padded; a state that cannot
    (forced here for qwen_gdn) takes them over a few forwards of the shortest
    remainder (not qwen4_exp: with its one session slot the second turns cannot
    all find their sessions)."""
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install, slots=1 if family == "qwen4_exp" else 4)
    if not ragged:
        monkeypatch.setattr(runner, "takes_ragged", lambda state: False)
    engine = Engine(runner, codec, max_batch=3)
    real = runner.forward_ragged
    prefills: list[tuple[int, ...]] = []

    def spy(chunks, positions, state, steer=None):
        prefills.append(tuple(len(chunk) for chunk in chunks))
        return real(chunks, positions, state, steer)

    monkeypatch.setattr(runner, "forward_ragged", spy)
    config = GenerationConfig(max_tokens=5, temperature=0.0, stop_token_ids=[])
    firsts = [
        Job(ids=[2, 10 + i, 30, 31, 32 + i, 40], config=config, emit=Collector()) for i in range(3)
    ]
    run_all(engine, [(0, job) for job in firsts])
    assert prefills == [(6, 6, 6)]
    if family == "qwen4_exp":
        for job in firsts:
            assert job.emit.tokens == alone(install, codec, job.ids, config).tokens
        return
    seconds = [
        Job(
            ids=[*job.ids, *job.emit.tokens, *range(50, 50 + 2 * i + 1)],
            config=config,
            emit=Collector(),
        )
        for i, job in enumerate(firsts)
    ]
    run_all(engine, [(0, job) for job in seconds])
    # The last reply token was never fed: 2, 4 and 6 tokens remain.
    if ragged:
        assert prefills[1:] == [(2, 4, 6)], prefills
    else:  # two for all three, then two for the two left, then two for the last
        assert prefills[1:] == [(2, 2, 2), (2, 2), (2,)], prefills
    for job in [*firsts, *seconds]:
        assert job.emit.error is None, job.emit.error
        assert job.emit.tokens == alone(install, codec, job.ids, config).tokens
    assert_sessions_sound(runner)


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn", "qwen4_exp"])
def test_seeded_rows_sampled_together_equal_each_alone(family, request):
    """Rows with their own temperature, top-k, top-p and seed draw in one batched
    sample per step, and each row's tokens are the same request's alone."""
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    slots = 1 if family == "qwen4_exp" else 4
    engine = Engine(open_runner(install, slots=slots), codec, max_batch=4)
    knobs = [
        {"temperature": 0.8, "seed": 1},
        {"temperature": 1.3, "top_k": 5, "seed": 2},
        {"temperature": 0.6, "top_p": 0.7, "seed": 3},
        {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 4},
    ]
    configs = [GenerationConfig(max_tokens=10, stop_token_ids=[], **k) for k in knobs]
    jobs = [
        Job(ids=list(p), config=c, emit=Collector())
        for p, c in zip(PROMPTS[:4], configs, strict=True)
    ]
    run_all(engine, [(0, job) for job in jobs])
    assert max(job.emit.chunks[-1].stats.batch_size for job in jobs) == 4
    for job, config in zip(jobs, configs, strict=True):
        assert job.emit.error is None, job.emit.error
        assert job.emit.tokens == alone(install, codec, job.ids, config).tokens, config


@pytest.mark.parametrize(
    ("wants", "cap", "width"),
    [
        ([2, 4, 6], None, 6),  # 6 padded tokens beside 12 real ones
        ([80] * 15 + [500], None, 80),  # the long prompt waits; the short ones end
        ([70, 100, 90, 75], 64, 64),  # the budget's share a row binds first
        ([1, 1, 1, 40], None, 1),  # 40 would pad 117 beside 43 real
    ],
)
def test_a_ragged_width_pads_at_most_as_many_tokens_as_it_feeds(wants, cap, width):
    assert _ragged_width(wants, cap) == width


@pytest.mark.parametrize(
    ("family", "kv_bits"), [("gemma4", None), ("qwen_gdn", None), ("gemma4", 8)]
)
def test_a_ragged_group_forward_equals_each_row_fed_alone(family, kv_bits, request, tmp_path):
    """Rows holding 0, 9 and 20 tokens (past gemma4's window of 8) take 1, 12
    and 5 more in one ragged forward: each row's logits at its own last token,
    and its state copied back out, equal the row fed alone (float32; a
    quantized K/V cache, on heads wide enough for its groups, shifts its
    three arrays alike)."""
    if kv_bits is None:
        install = request.getfixturevalue(f"{family}_install")
    else:
        install = tmp_path / "kvq"
        build_synthetic_install(
            family, install, vocab_size=128, num_layers=2, sliding_window=8, head_dim=32,
            global_head_dim=64, model_id="ragged-kvq", seed=3,
        )  # fmt: skip
    runner = Runner.open(
        install, context_length=CONTEXT, session_slots=4, kv_bits=kv_bits, kv_group_size=32
    )
    held, more = [0, 9, 20], [1, 12, 5]
    histories = [[3 + (5 * i + r) % 80 for i in range(n)] for r, n in enumerate(held)]
    chunks = [[4 + (3 * i + r) % 70 for i in range(n)] for r, n in enumerate(more)]
    sessions = []
    for history in histories:
        session = runner.checkout()
        if history:
            runner.feed(session, history, 0)
        sessions.append(session)
    state = runner.merge_states(sessions)
    assert runner.takes_ragged(state)
    for component in state.values():
        component.prepare(max(more))
    logits = runner.forward_ragged(chunks, held, state)
    for row, (history, chunk) in enumerate(zip(histories, chunks, strict=True)):
        extracted = {
            name: component.extract(row, len(history) + len(chunk), 0, None)
            for name, component in state.items()
        }
        solo = runner.checkout()  # a fresh session: the others are still out
        sessions.append(solo)
        expected = runner.feed(solo, [*history, *chunk], 0, logits=True)
        assert mx.allclose(logits[row], expected, atol=1e-4, rtol=1e-4).item(), row
        for name, component in solo.state.items():
            got, want = extracted[name].snapshot(), component.snapshot()
            assert got.keys() == want.keys(), (name, row)
            for key in want:
                assert got[key].shape == want[key].shape, (name, row, key)
                close = mx.allclose(got[key], want[key], atol=1e-4, rtol=1e-4).item()
                assert close, (name, row, key)
    for session in sessions:
        runner.checkin(session)


@pytest.mark.parametrize("failing", ["none", "last"])
@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_a_failed_batched_prefill_changes_no_session_and_the_rows_go_on_alone(
    family, request, monkeypatch, failing
):
    """Prompts of different lengths go in two forwards (all tokens but each
    row's last, padded; then the last): a failure in either, the second one
    after the rows were shifted past their padding, undoes the group."""
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install)
    engine = Engine(runner, codec, max_batch=3)
    real = runner._hook.turbospark_forward_batch
    raised = []

    def flaky(**kwargs):  # the hook's caller, as the runner calls it
        if kwargs["logits"] == failing and kwargs["tokens"].shape[0] == 3 and not raised:
            raised.append(tuple(kwargs["tokens"].shape))
            raise RuntimeError("a plugin failed mid-prefill")
        return real(**kwargs)

    flaky.get_hookimpls = real.get_hookimpls  # type: ignore[attr-defined]
    monkeypatch.setattr(runner._hook, "turbospark_forward_batch", flaky)
    config = GenerationConfig(max_tokens=6, temperature=0.0, stop_token_ids=[])
    jobs = [Job(ids=list(p), config=config, emit=Collector()) for p in PROMPTS[:3]]
    run_all(engine, [(0, job) for job in jobs])
    assert raised == [(3, 18 if failing == "none" else 1)], "the batched prefill never ran"
    for job in jobs:
        assert job.emit.error is None, job.emit.error
        assert job.emit.tokens == alone(install, codec, job.ids, config).tokens
    assert_sessions_sound(runner)


class FailingLayer:
    """A layer hook that raises after *layer*: a plugin failing inside the
    forward, once every layer up to it has written its state."""

    raised = 0

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, layer: int, h):
        if layer == self.layer:
            FailingLayer.raised += 1
            raise RuntimeError(f"a plugin failed inside layer {layer}")
        return h


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn", "qwen4_exp"])
def test_a_batched_forward_failing_midway_leaves_every_session_intact(
    family, phase, request, monkeypatch
):
    """The first batched prefill, or the third batched decode step, raises after
    its last layer, before the forward ends: every layer has appended its K/V,
    replaced its recurrent state and (qwen4_exp) extended its QSA index and
    both tails. The step is undone from what was held before it, every row goes
    on alone, and every request still equals itself run alone. qwen4_exp's
    prompts run past 15 tokens, where QSA is sparse and reads its index."""
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install, slots=1 if family == "qwen4_exp" else 4)
    real = runner.forward_batch
    calls = {"prefill": 0, "decode": 0}

    def failing(tokens, positions, state, steer=None):
        kind = "prefill" if tokens.shape[1] > 1 else "decode"
        calls[kind] += 1
        if kind == phase and calls[kind] == (1 if phase == "prefill" else 3):
            assert steer is None
            return real(tokens, positions, state, FailingLayer(runner.arch.num_hidden_layers - 1))
        return real(tokens, positions, state, steer)

    monkeypatch.setattr(runner, "forward_batch", failing)
    monkeypatch.setattr(FailingLayer, "raised", 0)
    config = GenerationConfig(max_tokens=16, temperature=0.0, stop_token_ids=[])
    # One length, so they are prefilled together: 14 tokens, sparse QSA from the 16th.
    prompts = [[*p, *PROMPTS[2][1:]][:14] for p in PROMPTS[:3]]
    jobs = [Job(ids=list(p), config=config, emit=Collector()) for p in prompts]
    run_all(Engine(runner, codec, max_batch=3), [(0, job) for job in jobs])
    assert FailingLayer.raised == 1, calls
    for job in jobs:
        assert job.emit.error is None, job.emit.error
        assert job.emit.tokens == alone(install, codec, job.ids, config).tokens
    assert_sessions_sound(runner)


def spy_prefills(runner, monkeypatch) -> list[tuple[int, int]]:
    """The ``(rows, tokens)`` of every prompt forward *runner* runs from now on:
    batched groups (``forward_batch`` over more than one token) and lone rows
    (``feed`` of a prompt's ids; a decode step feeds a lazy id)."""
    real_batch, real_feed = runner.forward_batch, runner.feed
    prefills: list[tuple[int, int]] = []

    def spy_batch(tokens, positions, state, steer=None):
        if tokens.shape[1] > 1:
            prefills.append(tuple(tokens.shape))
        return real_batch(tokens, positions, state, steer)

    def spy_feed(session, tokens, start, logits=False, then=None):
        if isinstance(tokens[0], int):
            prefills.append((1, len(tokens)))
        return real_feed(session, tokens, start, logits, then)

    monkeypatch.setattr(runner, "forward_batch", spy_batch)
    monkeypatch.setattr(runner, "feed", spy_feed)
    return prefills


@pytest.mark.parametrize("budget", [12, 14])
@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_prompts_left_without_budget_wait_for_a_group_instead_of_going_alone(
    family, budget, request, monkeypatch
):
    """Four 6-token prompts, *budget* prompt tokens a step. 12: two prompts end
    in one forward, then the next two, not four that each get 3 tokens a step
    (a group takes as many as fit in the budget). 14: the same, and the two
    left wait for the next step's budget and go together too, rather than one
    of them going alone in the 2 tokens left (a one-row forward of its whole
    prompt, past the budget). Each still equals its request alone."""
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install)
    engine = Engine(runner, codec, max_batch=4, prefill_budget=budget)
    prefills = spy_prefills(runner, monkeypatch)
    config = GenerationConfig(max_tokens=4, temperature=0.0, stop_token_ids=[])
    jobs = [
        Job(ids=[2, 10 + i, 30, 31, 32 + i, 40], config=config, emit=Collector()) for i in range(4)
    ]
    run_all(engine, [(0, job) for job in jobs])
    assert prefills == [(2, 6), (2, 6)]
    for job in jobs:
        assert job.emit.tokens == alone(install, codec, job.ids, config).tokens
    assert_sessions_sound(runner)


def _mixed_jobs() -> list[Job]:
    """Rows of every sampling kind a batch draws differently: plain greedy,
    greedy and seeded rows that keep logprobs (drawn with the plain ones, their
    logprobs in one table), a row with a logits processor (sampled alone), and
    a plain seeded row."""
    from turbospark.generation.logits_processors import Penalties

    kinds = [
        ({"temperature": 0.0}, None, False),
        ({"temperature": 0.0}, 3, False),
        ({"temperature": 0.9, "seed": 5}, 2, False),
        ({"temperature": 0.0}, 0, True),
        ({"temperature": 1.1, "top_k": 9, "seed": 6}, None, False),
    ]
    jobs = []
    for prompt, (knobs, top, penalised) in zip(PROMPTS, kinds, strict=True):
        config = GenerationConfig(max_tokens=8, stop_token_ids=[], **knobs)
        processors = [Penalties(presence=0.7, frequency=0.3)] if penalised else []
        jobs.append(
            Job(
                ids=list(prompt),
                config=config,
                emit=Collector(),
                processors=processors,
                top_logprobs=top,
            )
        )
    return jobs


@pytest.mark.parametrize("fail", [None, "forward", "ids"])
def test_rows_of_every_sampling_kind_batched_equal_each_alone(gemma4_install, monkeypatch, fail):
    """Tokens and logprobs of a mixed batch equal each request run alone. With
    *fail*, the third batched decode step raises in the forward or, after its
    rows sampled and kept their logprobs, when its ids are read; it is undone
    (the kept logprobs too) and every row goes on alone without a gap or a
    repeat in its logprobs."""
    codec = load_text(gemma4_install)
    runner = open_runner(gemma4_install, slots=6)
    real_batch, real_check = runner.forward_batch, runner.check_ids
    calls = {"decode": 0, "read": 0}

    def flaky_batch(tokens, positions, state, steer=None):
        calls["decode"] += tokens.shape[1] == 1
        if fail == "forward" and tokens.shape[1] == 1 and calls["decode"] == 3:
            raise RuntimeError("a plugin failed once")
        return real_batch(tokens, positions, state, steer)

    def flaky_check(tokens):
        calls["read"] += len(tokens) == 5
        if fail == "ids" and len(tokens) == 5 and calls["read"] == 3:
            raise RuntimeError("reading the ids failed once")
        return real_check(tokens)

    monkeypatch.setattr(runner, "forward_batch", flaky_batch)
    monkeypatch.setattr(runner, "check_ids", flaky_check)
    jobs = _mixed_jobs()
    run_all(Engine(runner, codec, max_batch=5), [(0, job) for job in jobs])
    assert max(job.emit.chunks[-1].stats.batch_size for job in jobs) == 5
    for job, expected in zip(jobs, _mixed_jobs(), strict=True):
        run_all(Engine(open_runner(gemma4_install), codec, max_batch=1), [(0, expected)])
        assert job.emit.error is None, job.emit.error
        assert job.emit.tokens == expected.emit.tokens, job.config
        got = [c.logprobs for c in job.emit.chunks if c.token is not None]
        want = [c.logprobs for c in expected.emit.chunks if c.token is not None]
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            if b is None:
                assert a is None
                continue
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)


def test_a_batched_step_reads_the_ids_queued_by_the_step_before(gemma4_install, monkeypatch):
    """The ids a step feeds, and the host then reads, are the very array the step
    before queued (no op built after the new step is queued, which would make
    the read wait for that step too); the outputs still equal each row alone."""
    from turbospark.generation.engine import _Batch

    codec = load_text(gemma4_install)
    engine = Engine(open_runner(gemma4_install), codec, max_batch=3)
    real_step, seen = _Batch.step, []

    def step(batch):
        queued = batch.tokens
        fed = real_step(batch)
        seen.append(fed is queued and batch.tokens is not queued)
        return fed

    monkeypatch.setattr(_Batch, "step", step)
    config = GenerationConfig(max_tokens=9, temperature=0.0, stop_token_ids=[])
    jobs = [Job(ids=list(p), config=config, emit=Collector()) for p in PROMPTS[:3]]
    run_all(engine, [(0, job) for job in jobs])
    assert seen and all(seen)
    for job in jobs:
        assert job.emit.tokens == alone(gemma4_install, codec, job.ids, config).tokens


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_rows_leaving_a_batch_one_by_one_hold_only_their_sessions(family, request):
    """A row's state is copied out of the batch when it leaves; the copy must
    not keep the batch's buffer alive while its session sits parked. Twelve
    rows leave one step apart: afterwards the memory in use beyond what it was
    before is the parked sessions' bytes (each row once pinned the buffer of
    every row still in the batch: about 50 times as much here)."""
    install = request.getfixturevalue(f"{family}_install")
    rows = 12
    runner = open_runner(install, slots=rows)
    engine = Engine(runner, load_text(install), max_batch=rows, prefill_budget=512)
    jobs = [
        Job(
            ids=[2, 3 + k, *range(10, 10 + 2 * k)],
            config=GenerationConfig(max_tokens=16 + k, temperature=0.0, stop_token_ids=[]),
            emit=Collector(),
        )
        for k in range(rows)
    ]
    before = memory_in_use()
    run_all(engine, [(0, job) for job in jobs])
    assert all(job.emit.error is None for job in jobs)
    assert max(c.stats.batch_size for job in jobs for c in job.emit.chunks if c.stats) == rows
    held = sum(runner.session_nbytes())
    assert held > 0
    assert memory_in_use() - before <= 2 * held + (1 << 20)


def test_rows_decoding_in_a_batch_leave_no_second_copy_in_their_sessions(gemma4_install):
    """A row's state is copied into the batch when it joins; its session kept
    its own arrays too, a second copy of every row's K/V for as long as the
    row decoded there (a third more memory than the batch here). While they
    decode together, the memory in use beyond what it was before is the
    batch's, and their sessions hold nothing of the step."""
    rows = 8
    runner = open_runner(gemma4_install, slots=rows + 1)
    engine = Engine(runner, load_text(gemma4_install), max_batch=rows, prefill_budget=4096)

    def jobs() -> list[Job]:
        return [
            Job(
                ids=[2, 3 + k, *((7 * i + k) % 100 + 10 for i in range(150))],
                config=GenerationConfig(max_tokens=40, temperature=0.0, stop_token_ids=[]),
                emit=Collector(),
            )
            for k in range(rows)
        ]

    run_all(engine, [(0, job) for job in jobs()])  # builds what the process keeps
    runner.forget_sessions()
    before = memory_in_use()
    for job in jobs():
        engine.submit(job)
    while engine.batch_size < rows:
        assert engine.step()
    engine.step()
    in_use = memory_in_use() - before
    assert in_use <= engine.batch_nbytes + engine.batch_nbytes // 4
    assert sum(row.session.nbytes for row in engine.in_flight()) == 0
    while engine.step():
        pass
    assert_sessions_sound(runner)


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_warm_up_decodes_at_every_batch_size_and_leaves_no_session(family, request, caplog):
    """Compiled pieces that are not shapeless trace once per batch size: the
    warm-up runs the batched decode at each size up to ``max_batch`` before the
    first real request, then forgets its sessions. Its log line times each round."""
    caplog.set_level(logging.INFO, logger="turbospark.generation.engine")
    install = request.getfixturevalue(f"{family}_install")
    runner = open_runner(install)
    engine = Engine(runner, load_text(install), max_batch=4, prefill_budget=16)
    sizes: list[int] = []
    real = engine._batch.step

    def step():
        sizes.append(len(engine._batch.rows))
        return real()

    engine._batch.step = step
    engine.warm_up([2, *range(5, 25)])
    assert set(sizes) == {1, 2, 3, 4}
    timed = re.search(r"warmed up in [\d.]+ s \((.*)\)", caplog.text)
    assert timed and [part.rsplit(" ", 2)[0] for part in timed[1].split(", ")] == list(
        WARM_UP_ROUNDS
    )
    assert not engine.warming and engine.active_rows == 0 and engine.queue_depth == 0
    assert all(session.position == 0 for session in runner.sessions())


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_a_request_during_the_warm_up_cuts_it_short_and_gets_the_reply_it_gets_after(
    family, request
):
    """A request that arrives during the warm-up waits only for the step under
    way: the warm-up's rows leave (no forward of theirs runs again), its
    sessions are forgotten, and the request's reply is the one it gets from an
    engine that warmed up whole, and from no warm-up at all."""
    install = request.getfixturevalue(f"{family}_install")
    config = GenerationConfig(max_tokens=6, temperature=0.0, stop_token_ids=[])
    prompt = [3, *range(40, 60)]
    replies, steps = [], []
    for cut in ("whole", "cut short", "none"):
        runner = open_runner(install)
        engine = Engine(runner, load_text(install), max_batch=4, prefill_budget=16)
        job = Job(ids=prompt, config=config, emit=Collector())
        real = engine.step
        steps.clear()

        def step(real=real, engine=engine, job=job, cut=cut):
            if cut == "cut short" and engine.warming and not steps:
                engine.submit(job)  # arrives during the warm-up's first step
            steps.append(engine.warming)
            return real()

        engine.step = step
        if cut != "none":
            engine.warm_up([2, *range(5, 25)])
        warm_steps = sum(steps)
        assert not engine.warming and all(s.position == 0 for s in runner.sessions())
        if cut == "whole":
            whole_steps = warm_steps
        elif cut == "cut short":  # its first step, the one its rows leave at, and the idle one
            assert warm_steps == 3 < whole_steps and engine.queue_depth == 1
        if cut != "cut short":
            engine.submit(job)
        while not job.emit.done:
            assert engine.step(), "the engine ran out of work before the request ended"
        assert job.emit.error is None
        replies.append(job.emit.tokens)
    assert replies[0] == replies[1] == replies[2]


def test_warm_up_neither_writes_nor_reads_the_session_directory(qwen_gdn_install, tmp_path):
    """The warm-up's sessions are throwaway: none reaches the session directory
    (at every start it would add its own), and a session already there is not
    restored in the warm-up's place; the directory serves real requests after."""

    def files() -> set[str]:
        return {p.name for p in tmp_path.glob("*.safetensors")}

    def start() -> tuple[Runner, Engine]:
        runner = Runner.open(
            qwen_gdn_install, context_length=CONTEXT, session_slots=4, session_dir=tmp_path
        )
        runner.set_prefix_reuse(True)
        return runner, Engine(runner, load_text(qwen_gdn_install), max_batch=4)

    runner, engine = start()
    engine.warm_up([2, *range(5, 25)])
    assert files() == set() and runner.session_disk is not None
    config = GenerationConfig(max_tokens=3, temperature=0.0, stop_token_ids=[])
    run_all(engine, [(0, Job(ids=list(range(3, 40)), config=config, emit=Collector()))])
    kept = files()
    assert len(kept) == 1  # a real request's session is written through
    runner.close()
    runner, engine = start()
    loads = []
    real_load = runner.session_disk.load
    runner.session_disk.load = lambda entry: loads.append(entry) or real_load(entry)
    engine.warm_up([3, *range(4, 40)])  # the real session's prompt would match: not read
    assert files() == kept and loads == []
    runner.close()


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_warm_up_prefills_groups_fresh_and_with_history(family, request):
    """A server's first turns prefill as groups of fresh rows and its next turns
    as groups of rows with history; on a GPU each path compiles kernels of its
    own the first time, so the warm-up takes both before any request does."""
    install = request.getfixturevalue(f"{family}_install")
    runner = open_runner(install)
    engine = Engine(runner, load_text(install), max_batch=4)
    groups: list[tuple[int, int, bool]] = []  # rows, new tokens, every row held some
    real = runner.forward_ragged

    def forward(chunks, positions, state, steer=None):
        groups.append((len(chunks), max(len(c) for c in chunks), min(positions) > 0))
        return real(chunks, positions, state, steer)

    runner.forward_ragged = forward
    engine.warm_up([2, *range(5, 25)])
    assert any(rows > 1 and not held for rows, _, held in groups)
    assert any(rows > 1 and held for rows, _, held in groups)
    assert not engine.warming and engine.active_rows == 0
    assert all(session.position == 0 for session in runner.sessions())


def _record_forward_kinds(runner: Runner, kinds: set[tuple[str, bool, bool, bool, bool]]) -> None:
    """Record each forward's kind into *kinds*: which hook (one row or a batch),
    whether it takes the compiled step functions, one row, one token, and
    whether every row already held tokens. Kernels compile per op graph, and
    these are what choose a forward's graph (its shape within a kind does not)."""
    real_batch, real_feed = runner.forward_batch, runner._feed

    def forward_batch(tokens, positions, state, steer=None):
        rows, length = tokens.shape
        kinds.add(
            ("batch", runs_compiled(rows, length), rows == 1, length == 1, min(positions) > 0)
        )
        return real_batch(tokens, positions, state, steer)

    def feed(tokens, start, want, session=None, then=None):
        kinds.add(("row", runs_compiled(1, len(tokens)), True, len(tokens) == 1, start > 0))
        return real_feed(tokens, start, want, session, then)

    real_ragged = runner.forward_ragged

    def forward_ragged(chunks, positions, state, steer=None):
        if len({len(chunk) for chunk in chunks}) > 1:  # else forward_batch records it
            kinds.add(("ragged", False, len(chunks) == 1, False, min(positions) > 0))
        return real_ragged(chunks, positions, state, steer)

    runner.forward_batch, runner._feed = forward_batch, feed
    runner.forward_ragged = forward_ragged


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_warm_up_runs_every_kind_of_forward_that_chat_traffic_runs(family, request):
    """Chat traffic's kinds of forward are all run by the warm-up first: on a GPU
    a kind's first forward compiles its kernels (seconds each) while every row
    batched with it waits. Four clients' first turns (fresh, of uneven lengths)
    then their next turns (with history, uneven again) prefill as groups whose
    rows end a few tokens apart, so the last rows' few tokens run alone through
    the compiled step functions: the forward a 16-client qwen_gdn server on the
    H200 stalled 14 s on compiling when the warm-up's groups were all even."""
    install = request.getfixturevalue(f"{family}_install")
    runner = open_runner(install)
    engine = Engine(runner, load_text(install), max_batch=4)
    warm: set[tuple[str, bool, bool, bool, bool]] = set()
    _record_forward_kinds(runner, warm)
    engine.warm_up([0] * (CONTEXT - 4))  # what serve passes when the context bounds it
    del runner.forward_batch, runner._feed, runner.forward_ragged
    traffic: set[tuple[str, bool, bool, bool, bool]] = set()
    _record_forward_kinds(runner, traffic)
    config = GenerationConfig(max_tokens=4, temperature=0.0, stop_token_ids=[])
    turns = [[3 + k, *range(10, 30 + 3 * k)] for k in range(4)]
    for more in range(2):
        jobs = [(0, Job(ids=list(p), config=config, emit=Collector())) for p in turns]
        run_all(engine, jobs)
        turns = [
            [*p, *job.emit.tokens, *range(40 + more, 60 + 2 * k)]
            for k, (p, (_, job)) in enumerate(zip(turns, jobs, strict=True))
        ]
    assert traffic - warm == set()


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_a_group_takes_the_rows_whose_forward_fits_the_budget(family, request, monkeypatch):
    """Prompts of 6, 6, 7 and 8 tokens, 24 prompt tokens a step. Their
    shortest reach (6) times four fits, but a ragged forward of the four is 8
    wide: the group is the first three (7 wide, 21 tokens), each ending in
    its one forward, where the four cut to 6 each took a second forward for
    the longer rows' last tokens. Each still equals its request alone."""
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install)
    engine = Engine(runner, codec, max_batch=4, prefill_budget=24)
    fed: list[list[int]] = []
    real = runner.forward_ragged

    def spy(chunks, positions, state, steer=None):
        fed.append([len(chunk) for chunk in chunks])
        return real(chunks, positions, state, steer)

    monkeypatch.setattr(runner, "forward_ragged", spy)
    config = GenerationConfig(max_tokens=4, temperature=0.0, stop_token_ids=[])
    jobs = [
        Job(ids=[2, 10 + i, 30, 31, 32 + i, 40, *range(50, 50 + extra)], config=config, emit=Collector())
        for i, extra in enumerate([0, 0, 1, 2])
    ]  # fmt: skip
    run_all(engine, [(0, job) for job in jobs])
    assert fed == [[6, 6, 7]], fed  # the fourth went alone, in the budget left and the next
    for job in jobs:
        assert job.emit.tokens == alone(install, codec, job.ids, config).tokens
    assert_sessions_sound(runner)


@pytest.mark.parametrize(("ragged", "size"), [(None, 3), (True, 3), (False, 4)])
def test_groups_that_are_not_ragged_count_by_the_shortest_reach(ragged, size):
    """Before any group has formed, and where groups take ragged rows, the
    group is counted by its ragged width; where they do not (a family whose
    components neither shift nor pad rows), every row is fed the shortest
    reach, so that is what counts."""
    engine = Engine.__new__(Engine)
    engine._ragged = ragged
    config = GenerationConfig(max_tokens=4)
    rows = [
        SimpleNamespace(job=SimpleNamespace(ids=[1] * n, config=config, checkpoint_at=None), next_prefill=0)
        for n in (6, 6, 7, 8)
    ]  # fmt: skip
    assert engine._group_within(rows, 24) == rows[:size]
    assert engine._group_within(rows, None) == rows


# -- admission waits for requests on their way in (Engine.expect) ---------------------
# A server tells the engine of each request whose prompt it is still preparing; a
# prompt queued meanwhile waits for it, at most ``gather_s``, so that a burst
# prefills in one group.

GATHER_CONFIG = GenerationConfig(max_tokens=4, temperature=0.0, stop_token_ids=[])


def _gather_jobs(count: int) -> list[Job]:
    return [
        Job(ids=[2, 10 + i, 30, 31, 32 + i, 40], config=GATHER_CONFIG, emit=Collector())
        for i in range(count)
    ]


def _finish_jobs(engine: Engine, jobs: list[Job], limit: int = 500) -> None:
    for _ in range(limit):
        engine.step()
        if all(job.emit.done for job in jobs):
            return
    raise AssertionError("the engine did not finish every job")


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_a_prompt_waits_for_a_request_on_its_way_and_both_prefill_in_one_forward(
    family, request, monkeypatch
):
    """A job queued while another request is announced is not admitted (no
    forward runs, however many steps); once the other is submitted and done,
    both prefill in one forward of two rows, and each equals its request alone."""
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install)
    engine = Engine(runner, codec, max_batch=4, gather_s=30.0)
    prefills = spy_prefills(runner, monkeypatch)
    first, second = _gather_jobs(2)
    coming = engine.expect()
    engine.submit(first)
    for _ in range(3):
        assert not engine.step()
    assert engine.active_rows == 0 and prefills == []
    engine.submit(second)
    coming.done()
    _finish_jobs(engine, [first, second])
    assert prefills == [(2, 6)]
    for job in (first, second):
        assert job.emit.tokens == alone(install, codec, job.ids, GATHER_CONFIG).tokens
    assert_sessions_sound(runner)


def test_a_request_never_submitted_holds_the_queue_at_most_gather_s(gemma4_install, monkeypatch):
    """An announced request that never arrives (refused, or its client left)
    delays the queued prompt by at most ``gather_s``, then it goes alone."""
    codec = load_text(gemma4_install)
    runner = open_runner(gemma4_install)
    engine = Engine(runner, codec, max_batch=4, gather_s=0.2)
    prefills = spy_prefills(runner, monkeypatch)
    (job,) = _gather_jobs(1)
    engine.expect()
    engine.submit(job)
    assert not engine.step()
    time.sleep(0.25)
    _finish_jobs(engine, [job])
    assert prefills == [(1, 6)]
    assert job.emit.tokens == alone(gemma4_install, codec, job.ids, GATHER_CONFIG).tokens


@pytest.mark.parametrize("gather_s", [0.0, 30.0])
def test_a_prompt_with_nothing_on_its_way_is_admitted_at_once(gemma4_install, gather_s):
    """Nothing announced (a library caller, a lone client), or gathering off
    (``gather_s=0``, whatever is announced): the first step admits the prompt."""
    engine = Engine(open_runner(gemma4_install), load_text(gemma4_install), gather_s=gather_s)
    if not gather_s:
        engine.expect()
    (job,) = _gather_jobs(1)
    engine.submit(job)
    assert engine.step()
    assert engine.active_rows == 1


def test_a_full_batch_does_not_wait(gemma4_install):
    """Queued rows that already fill the batch have no room for more: they are
    admitted at once, whatever is announced."""
    engine = Engine(
        open_runner(gemma4_install), load_text(gemma4_install), max_batch=2, gather_s=30.0
    )
    engine.expect()
    for job in _gather_jobs(2):
        engine.submit(job)
    assert engine.step()
    assert engine.active_rows == 2


def test_the_loop_sleeps_while_it_waits_and_wakes_when_the_request_arrives(
    gemma4_install, monkeypatch
):
    """:meth:`Engine.run` with a held prompt and nothing active: it steps a
    bounded number of times while waiting (it sleeps on the announcement, it
    does not spin), and the request's submission wakes it for one group."""
    codec = load_text(gemma4_install)
    runner = open_runner(gemma4_install)
    engine = Engine(runner, codec, max_batch=4, gather_s=30.0)
    prefills = spy_prefills(runner, monkeypatch)
    steps = 0
    real_step = engine.step

    def counted() -> bool:
        nonlocal steps
        steps += 1
        return real_step()

    monkeypatch.setattr(engine, "step", counted)
    first, second = _gather_jobs(2)
    coming = engine.expect()
    engine.submit(first)
    stop = threading.Event()
    loop = threading.Thread(target=engine.run, args=(stop,))
    loop.start()
    try:
        time.sleep(0.3)
        assert steps <= 3, steps
        engine.submit(second)
        coming.done()
        deadline = time.monotonic() + 60
        while not (first.emit.done and second.emit.done):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        stop.set()
        loop.join()
    assert prefills == [(2, 6)]


def test_gather_s_is_checked():
    with pytest.raises(ValueError, match="gather_s must be at least 0"):
        Engine(None, None, gather_s=-1.0)  # type: ignore[arg-type]
