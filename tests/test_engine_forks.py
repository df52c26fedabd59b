"""n > 1: a job's forks start from its one prefill, by reference, and equal the
same requests run alone.

Each check compares two paths: the n completions of one prompt (a job and its
forks, rows of one batch) against :func:`turbospark.generation.generate.generate` run
once per completion on a fresh runner. Float32 on the CPU.
"""

from __future__ import annotations

import pytest
from test_engine import Collector, alone, assert_sessions_sound, open_runner

from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import GenerationConfig
from turbospark.generation.runner import Runner
from turbospark.sessions.reuse import ReuseReason
from turbospark.text import load_text

PROMPT = [2, 5, 9, 14, 20, 31, 40, 41, 42]


def count_prefill(runner: Runner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Prompt tokens fed through the one-row forward (decode feeds start at the prompt's end)."""
    fed: list[int] = []
    feed = runner.feed

    def counting(session, ids, position, logits=False, then=None):
        fed.extend(p for p in range(position, position + len(ids)) if p < len(PROMPT))
        return feed(session, ids, position, logits=logits, then=then)

    monkeypatch.setattr(runner, "feed", counting)
    return fed


def run_all(engine: Engine, jobs: list[tuple[int, Job]], limit: int = 2000) -> None:
    """Step the engine (every job submitted at once) until each job and fork is done."""
    for _, job in jobs:
        engine.submit(job)
    every = [each for _, job in jobs for each in (job, *job.forks)]
    for _ in range(limit):
        engine.step()
        if all(job.emit.done for job in every):
            return
    raise AssertionError("the engine did not finish every job")


def group(configs: list[GenerationConfig]) -> Job:
    lead, *rest = [Job(ids=list(PROMPT), config=c, emit=Collector()) for c in configs]
    lead.forks = rest
    return lead


@pytest.mark.parametrize(
    ("family", "max_batch"), [("gemma4", 4), ("qwen_gdn", 2), ("qwen4_exp", 4)]
)
def test_greedy_forks_equal_one_completion_and_prefill_once(
    family, max_batch, request, monkeypatch
):
    """n=3 at temperature 0: three equal completions, equal to n=1, one prefill;
    with max_batch 2 the group of three still runs (it is admitted whole)."""
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install, slots=1 if family == "qwen4_exp" else 4)
    fed = count_prefill(runner, monkeypatch)
    engine = Engine(runner, codec, max_batch=max_batch, prefill_budget=4)
    config = GenerationConfig(max_tokens=8, temperature=0.0, stop_token_ids=[], chunk_size=3)
    lead = group([config] * 3)
    run_all(engine, [(0, lead)])
    assert sorted(fed) == list(range(len(PROMPT)))  # every prompt position fed exactly once
    expected = alone(install, codec, PROMPT, config)
    for job in [lead, *lead.forks]:
        assert job.emit.error is None, job.emit.error
        assert job.emit.tokens == expected.tokens, family
    for fork in lead.forks:
        stats = fork.emit.chunks[-1].stats
        assert stats.reuse_reason == ReuseReason.FORKED
        assert stats.reused_tokens == stats.prompt_tokens == len(PROMPT)
    if runner.batchable:  # the three are rows of one batch, even past max_batch
        assert lead.emit.chunks[-1].stats.batch_size == 3
    assert engine.active_rows == 0
    assert_sessions_sound(runner)


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn", "qwen4_exp"])
def test_seeded_forks_each_equal_a_request_with_that_seed(family, request):
    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    runner = open_runner(install, slots=1 if family == "qwen4_exp" else 4)
    engine = Engine(runner, codec, max_batch=4, prefill_budget=4)
    configs = [
        GenerationConfig(
            max_tokens=10, temperature=1.3, seed=7 + j, stop_token_ids=[], chunk_size=3
        )
        for j in range(3)
    ]
    lead = group(configs)
    run_all(engine, [(0, lead)])
    outs = [job.emit.tokens for job in [lead, *lead.forks]]
    for tokens, config in zip(outs, configs, strict=True):
        assert tokens == alone(install, codec, PROMPT, config).tokens
    assert len({tuple(t) for t in outs}) > 1  # different seeds, not one sample thrice


def test_only_the_first_completion_is_kept_and_it_resumes(gemma4_install):
    """Forks' sessions are dropped: the pool gains one conversation, the first
    choice's, and a follow-up extending it reuses it whole."""
    codec = load_text(gemma4_install)
    runner = open_runner(gemma4_install)
    engine = Engine(runner, codec, max_batch=4)
    config = GenerationConfig(max_tokens=5, temperature=1.0, seed=3, stop_token_ids=[])
    seeded = [config.model_copy(update={"seed": 3 + j}) for j in range(3)]
    lead = group(seeded)
    run_all(engine, [(0, lead)])
    held = [state for state in runner.session_states() if any(c.position for c in state.values())]
    assert len(held) == 1
    follow = Job(ids=PROMPT + lead.emit.tokens[:-1] + [50], config=config, emit=Collector())
    run_all(engine, [(0, follow)])
    assert follow.emit.chunks[-1].stats.reused_tokens == len(PROMPT) + len(lead.emit.tokens) - 1


def test_a_cancelled_group_while_queued_never_starts_and_a_refusal_reaches_every_fork(
    gemma4_install,
):
    codec = load_text(gemma4_install)
    runner = open_runner(gemma4_install)
    engine = Engine(runner, codec, max_batch=4)
    config = GenerationConfig(max_tokens=4, temperature=0.0, stop_token_ids=[])
    cancelled = group([config] * 2)
    for job in [cancelled, *cancelled.forks]:
        job.cancelled.set()
    too_long = Job(ids=[2] * 1000, config=config, emit=Collector())
    too_long.forks = [Job(ids=[2] * 1000, config=config, emit=Collector())]
    run_all(engine, [(0, cancelled), (0, too_long)])
    assert all(j.emit.tokens == [] for j in [cancelled, *cancelled.forks])
    assert all(j.emit.error is not None for j in [too_long, *too_long.forks])
    with pytest.raises(ValueError, match="forks"):
        engine.submit(Job(ids=[2, 3], config=config, emit=Collector(), forks=[too_long]))
