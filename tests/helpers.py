"""Small drivers shared by the runner-level tests: the `feed` shapes of the seed
scenarios (`tests/test_seed_scenarios.py`), and a batched greedy decode."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from turbospark import MropePositions, Runner


def feed(runner: Runner, tokens: Sequence[int]) -> mx.array:
    """The sequential path: every token but the last through ``produce_prefill``,
    the last through ``produce`` (the seed's `feed`)."""
    last = len(tokens) - 1
    for position, token in enumerate(tokens[:-1]):
        runner.produce_prefill(token, position)
    return runner.produce(tokens[last], last)


def feed_chunked(runner: Runner, prompt: Sequence[int], reply: Sequence[int]) -> mx.array:
    """The server's path: the prompt as one chunk, then the reply token by token."""
    logits = runner.prefill_chunk(prompt, 0)
    for i, token in enumerate(reply):
        logits = runner.produce(token, len(prompt) + i)
    return logits


def serve_turn(runner: Runner, prompt: Sequence[int]) -> tuple[int, mx.array]:
    """The caller contract: reuse what matches, else reset; feed the rest from ``kept``."""
    kept = runner.try_reuse_prefix(prompt)
    if kept == 0:
        runner.reset()
        kept = runner.share_prefix(prompt)
    logits = runner.prefill_chunk(prompt[kept:], kept)
    runner.checkpoint()
    return kept, logits


def text_positions(length: int) -> MropePositions:
    return MropePositions(triples=[(i, i, i) for i in range(length)], rope_delta=0, spans=[])


def open_runner(path, session_slots: int) -> Runner:
    """A runner as the server opens one: reuse on, 4096 context."""
    runner = Runner.open(path, context_length=4096, session_slots=session_slots)
    runner.set_prefix_reuse(True)
    return runner


def batched_greedy(runner: Runner, prompts: Sequence[Sequence[int]], steps: int) -> list[mx.array]:
    """Each prompt prefilled into its own session, the sessions merged, then
    *steps* batched greedy decode steps (each row fed its own argmax, the
    prompt's last token first): every step's ``(B, vocab)`` logits."""
    sessions = []
    for prompt in prompts:
        session = runner.checkout()
        runner.feed(session, list(prompt), 0)
        sessions.append(session)
    state = runner.merge_states(sessions)
    positions = [len(p) for p in prompts]
    tokens = mx.array([[p[-1]] for p in prompts], dtype=mx.int32)
    out = []
    for _ in range(steps):
        for component in state.values():
            component.prepare(1)
        logits = runner.forward_batch(tokens, positions, state)
        out.append(logits)
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
        positions = [p + 1 for p in positions]
        mx.eval(logits, tokens)
    return out


def assert_states_close(
    got: dict[str, list[mx.array]], want: dict[str, list[mx.array]], atol: float
) -> None:
    """Every component's arrays (``{name: component.arrays()}``) of two runs,
    the same count of each, equal to *atol* (absolute and relative)."""
    for name, arrays in want.items():
        for i, (a, b) in enumerate(zip(got[name], arrays, strict=True)):
            np.testing.assert_allclose(
                np.array(a), np.array(b), atol=atol, rtol=atol, err_msg=f"{name} array {i}"
            )
