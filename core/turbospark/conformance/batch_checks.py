"""Batching: sessions decoded together equal each session decoded alone.

Two checks, for every family:

- **the batched forward** (families whose components are all ``batchable``
  and that implement ``turbospark_forward_batch``): sessions at different
  positions are merged, stepped together, joined and left between steps, and
  one goes back a token (a stop id fed speculatively). Every row's logits
  equal the same session stepped alone, and every row copied back out
  continues exactly. A family that is not batchable skips this, naming why:
  the engine then decodes its rows one at a time, with the same results;
- **schedules through the engine** (hypothesis): requests join at random
  steps, leave at random lengths, are cancelled; between steps the runner
  serves image-tainted turns and snapshot/restores its live session. Every
  request's tokens equal the same request run alone, and every image turn's
  logits equal a fresh run with the same map.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import final

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turbospark.conformance.diagnose import component_differences, fail, no_component_differs
from turbospark.conformance.kit import FamilyKit, kit_settings
from turbospark.conformance.turns import take_turn
from turbospark.conformance.vision_checks import install_vision
from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import Chunk, GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.state.components import State
from turbospark.text import load_text

TEMPLATE = 3


class BatchChecks:
    """Batched decoding never mixes rows up, and equals decoding alone."""

    @final
    def test_batched_rows_equal_each_row_alone(self, kit: FamilyKit) -> None:
        """Rows at 3, 11, 6 and 21 tokens (past a small window), joined two by
        two, one leaving mid-way and one going back a token: each row's logits
        equal the same session alone, and each row extracted continues exactly."""
        runner = kit.open(1)
        if not runner.batchable:
            plain = [c.name for c in kit.spec.components if not c.batchable]
            why = f"components {', '.join(plain)} are not batchable" if plain else (
                "the family has no turbospark_forward_batch"
            )  # fmt: skip
            pytest.skip(f"not batchable: {why}; the engine decodes its rows one at a time")
        histories = [kit.tokens(90 + i, n) for i, n in enumerate((3, 11, 6, 21))]
        alone = [kit.fresh_run(h) for h in histories]  # each on a model of its own
        rows = list(range(2))  # row i of the batch is session rows[i]
        batch = _merge([kit.prefilled_state(h) for h in histories[:2]])
        for step in range(6):
            if step == 2:  # two more sessions join
                joining = _merge([kit.prefilled_state(h) for h in histories[2:]])
                for name, component in batch.items():
                    component.extend(joining[name])
                rows += [2, 3]
            if step == 4:  # session 1 leaves, copied back out
                i = rows.index(1)
                _check_extracted(kit, batch, i, histories[1], "session 1 leaving at step 4")
                keep = [j for j in range(len(rows)) if j != i]
                for component in batch.values():
                    component.filter(keep)
                rows.remove(1)
            tokens = [kit.tokens(200 + 10 * step + s, 1)[0] for s in rows]
            for component in batch.values():
                component.prepare(1)
            held = {name: component.hold() for name, component in batch.items()}
            out = kit.hook.turbospark_forward_batch(
                model=kit.model,
                tokens=mx.array(tokens, dtype=mx.int32)[:, None],
                positions=[len(histories[s]) for s in rows],
                state=batch,
                logits="last",
                steer=None,
            )
            if step == 3:  # session 0's token was a stop: it goes back one, then leaves
                i = rows.index(0)
                back = {
                    name: component.extract(i, len(histories[0]), 1, held[name])
                    for name, component in batch.items()
                }
                probe = kit.tokens(300, 1)
                got = kit.forward(back, probe, len(histories[0]))
                gap = kit.logits_gap(got, kit.fresh_logits([*histories[0], *probe]))
                if gap is not None:
                    fail(
                        f"a row extracted one token back (a stop id) is {gap:.3g} off a fresh run; "
                        + _explain_row(
                            kit, back, kit.fresh_state([*histories[0], *probe]), "a fresh run"
                        )
                    )
            for i, s in enumerate(rows):
                expected = alone[s].forward([tokens[i]], len(histories[s]))
                gap = kit.logits_gap(out[i], expected)
                if gap is not None:
                    row = {
                        name: component.extract(i, len(histories[s]) + 1, 0, component.hold())
                        for name, component in batch.items()
                    }
                    fail(
                        f"batched step {step}, row {i} (a {len(histories[s])}-token session "
                        f"among {len(rows)}): logits {gap:.3g} off the same session alone; row {i} "
                        "copied out of the batch: "
                        + _explain_row(kit, row, alone[s].state, "the same session alone")
                    )
                histories[s] = [*histories[s], tokens[i]]
            mx.eval(out, *(a for c in batch.values() for a in c.arrays()))
            if step == 3:
                i = rows.index(0)
                keep = [j for j in range(len(rows)) if j != i]
                for component in batch.values():
                    component.filter(keep)
                rows.remove(0)
        for i, s in enumerate(rows):
            _check_extracted(kit, batch, i, histories[s], f"session {s} at the end")

    @final
    def test_engine_schedules_never_cross_talk(self, kit: FamilyKit) -> None:
        """Random joins, lengths and cancellations, with image turns and
        snapshot/restores between steps: every request equals itself alone."""
        codec = load_text(kit.install)
        slots = 1 if kit.not_swappable else 3
        alone: dict[tuple[tuple[int, ...], int], list[int]] = {}

        def expected(ids: tuple[int, ...], max_tokens: int) -> list[int]:
            if (ids, max_tokens) not in alone:  # each reference on a runner (a model) of its own
                done = generate(kit.open(1, reuse=False), codec, list(ids), _config(max_tokens))
                alone[(ids, max_tokens)] = done.tokens
            return alone[(ids, max_tokens)]

        @kit_settings(kit)
        @given(plan=_plans(kit))
        def play(plan: _Plan) -> None:
            runner = kit.open(slots, context=f"{plan!r}: ")
            engine = Engine(runner, codec, max_batch=plan.max_batch, prefill_budget=4)
            outputs: list[list[Chunk | Exception]] = [[] for _ in plan.requests]
            found: dict[int, str] = {}  # request -> what its session held when it ended

            def emit(i: int, chunk: Chunk | Exception) -> None:
                """Keep the chunk; when the request ends off its reference, name
                what its session (live again once checked in) holds wrongly."""
                outputs[i].append(chunk)
                if (
                    isinstance(chunk, Chunk)
                    and chunk.finish_reason
                    and not jobs[i].cancelled.is_set()
                ):
                    got = [
                        c.token for c in outputs[i] if isinstance(c, Chunk) and c.token is not None
                    ]
                    r = plan.requests[i]
                    if got != expected(r.ids, r.max_tokens):
                        found[i] = _explain_request(kit, runner)

            jobs = [
                Job(ids=list(r.ids), config=_config(r.max_tokens), emit=partial(emit, i))
                for i, r in enumerate(plan.requests)
            ]
            for step in range(200):
                for i, r in enumerate(plan.requests):
                    if r.submit_at == step:
                        engine.submit(jobs[i])
                    if r.cancel_at == step:
                        jobs[i].cancelled.set()
                for event in plan.events:
                    if event.at == step:
                        _runner_event(kit, runner, event, f"{plan!r}, step {step}: ")
                busy = engine.step()
                if not busy and step > max(r.submit_at for r in plan.requests):
                    break
            for i, r in enumerate(plan.requests):
                out = outputs[i]
                if out and isinstance(out[-1], Exception):
                    raise out[-1]
                if not out or out[-1].finish_reason is None:
                    fail(f"{plan!r}: request {i} never finished ({out[-1:] or 'no output'})")
                if jobs[i].cancelled.is_set():
                    continue
                got = [c.token for c in out if c.token is not None]
                want = expected(r.ids, r.max_tokens)
                if got != want:
                    fail(
                        f"{plan!r}: request {i} decoded beside others gave {got}, alone {want} "
                        f"(peak batch {out[-1].stats.batch_size if out[-1].stats else '?'}); "
                        + found.get(i, "its session was not inspected")
                    )
            kit.check_apart(runner, f"{plan!r}, after the schedule: ")

        play()


def _explain_request(kit: FamilyKit, runner: Runner) -> str:
    """What the live session (a request's, just checked in) holds that a fresh
    run of its tokens does not: component, layer (the entry's prefix) and index."""
    session = runner.sessions()[0]
    history = session.record.tokens
    found = component_differences(kit, session.state, kit.fresh_state(history))
    return f"its session, holding {len(history)} tokens, against a fresh run of them: " + (
        "; ".join(found) or no_component_differs(kit, runner.model)
    )


def _merge(states: list[State]) -> State:
    return {name: type(c).merge([s[name] for s in states]) for name, c in states[0].items()}


def _explain_row(kit: FamilyKit, state: State, reference: State, against: str) -> str:
    """Which component, layer and entry of a row differ from *reference*."""
    found = component_differences(kit, state, reference, against)
    return "; ".join(found) or f"every component equals {against}'s: the forward itself diverged"


def _check_extracted(kit: FamilyKit, batch: State, row: int, history: list[int], what: str) -> None:
    """Row *row* copied out of the batch continues exactly like a fresh run."""
    state = {
        name: component.extract(row, len(history), 0, component.hold())
        for name, component in batch.items()
    }
    probe = kit.tokens(400 + len(history), 2)
    got = kit.forward(state, probe, len(history))
    gap = kit.logits_gap(got, kit.fresh_logits([*history, *probe]))
    if gap is not None:
        fail(
            f"{what}: the row copied out of the batch continues {gap:.3g} off a fresh run; "
            + _explain_row(kit, state, kit.fresh_state([*history, *probe]), "a fresh run")
        )


def _config(max_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[], chunk_size=5)


@dataclass(frozen=True)
class _Request:
    ids: tuple[int, ...]
    max_tokens: int
    submit_at: int
    cancel_at: int | None


@dataclass(frozen=True)
class _Event:
    at: int
    kind: str  # "image": a tainted turn on the live session; "snapshot": snapshot/junk/restore
    seed: int


@dataclass(frozen=True)
class _Plan:
    max_batch: int
    requests: tuple[_Request, ...]
    events: tuple[_Event, ...]

    def __repr__(self) -> str:
        reqs = ", ".join(
            f"{len(r.ids)}t+{r.max_tokens}@{r.submit_at}"
            + ("" if r.cancel_at is None else f"x{r.cancel_at}")
            for r in self.requests
        )
        events = ", ".join(f"{e.kind}@{e.at}" for e in self.events)
        return f"Plan(batch {self.max_batch}: {reqs}; {events or 'no runner events'})"


@st.composite
def _plans(draw: st.DrawFn, kit: FamilyKit) -> _Plan:
    template = tuple(kit.tokens(0, TEMPLATE))
    vocab = st.integers(0, kit.arch.vocab_size - 1)
    requests = []
    for _ in range(draw(st.integers(2, 5))):
        ids = template + tuple(draw(st.lists(vocab, min_size=1, max_size=9)))
        cancel = draw(st.one_of(st.none(), st.integers(0, 8)))
        requests.append(_Request(ids, draw(st.integers(1, 6)), draw(st.integers(0, 4)), cancel))
    events = [
        _Event(draw(st.integers(0, 8)), draw(st.sampled_from(["image", "snapshot"])), seed)
        for seed in range(draw(st.integers(0, 2)))
    ]
    return _Plan(draw(st.integers(1, 3)), tuple(requests), tuple(events))


def _runner_event(kit: FamilyKit, runner, event: _Event, context: str) -> None:
    """Between two engine steps, use the runner's live session directly."""
    if event.kind == "snapshot":
        snap = runner.snapshot()
        junk = kit.tokens(500 + event.seed, 3)
        runner.prefill_chunk(junk, runner.position, logits=False)
        runner.restore(snap)
        return
    prompt = [*kit.tokens(0, TEMPLATE), *kit.tokens(600 + event.seed, 6)]
    install_vision(kit, runner, len(prompt), event.seed)
    try:
        turn = take_turn(runner, "image", prompt)
        fresh = kit.open(1)
        install_vision(kit, fresh, len(prompt), event.seed)
        expected = fresh.prefill_chunk(prompt, 0)
        gap = kit.logits_gap(turn.logits, expected)
        if gap is not None:
            fail(f"{context}an image turn beside batched requests is {gap:.3g} off a fresh run")
    finally:
        runner.clear_prompt_vision()
