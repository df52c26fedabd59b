"""Prefill computes only what the state needs for tokens whose logits nobody reads.

MLX evaluates lazily: what the runner evaluates after a forward (the state
arrays, and the logits where wanted) decides what runs. These tests read the
graph behind those arrays and check which layers' outputs are in it: for a
chunk whose logits are not wanted, no output of the last state-writing layer
or of any layer after it (their keys/values and recurrent state come from
their inputs); for the chunk whose last token's logits are wanted, the same
for every other token, and every layer for the last token alone. The
results themselves are held equal by the existing suite (chunked against
sequential, batched against alone, against mlx-lm).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from turbospark import build_synthetic_install
from turbospark.generation.runner import Runner
from turbospark.state.kv import LayerKV

VOCAB = 128
# (family, the last layer that writes state): gemma4's last two of four layers
# share the K/V of earlier ones and write none; every qwen_gdn layer writes.
FAMILIES = [("gemma4", 1), ("qwen_gdn", 3)]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f for f, _ in FAMILIES])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    name, last_writer = request.param
    path = tmp_path_factory.mktemp(name)
    build_synthetic_install(
        name, path, vocab_size=VOCAB, num_layers=4, model_id=f"prefill-work-{name}", seed=0
    )
    runner = Runner.open(path, context_length=256)
    yield runner, last_writer
    runner.close()


def _nodes(arrays: list[mx.array]) -> int:
    """Nodes (primitives and arrays) of the unevaluated graph behind *arrays*."""
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(dot), *arrays)
        return len(re.findall(r"^\{ ", dot.read_text(), flags=re.MULTILINE))


def _in_graph(outputs: list[mx.array], array: mx.array) -> bool:
    """Whether evaluating *outputs* computes *array*: adding it adds no node."""
    return _nodes([*outputs, array]) == _nodes(outputs)


@contextmanager
def recorded(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[dict[int, mx.array]]]:
    """Each forward's layer outputs ``{layer: output}``, in the order the
    forwards ran (a forward begins where layer 0 runs)."""
    layers = list(runner.model.model.layers)
    cls = type(layers[0])
    real = cls.__call__
    forwards: list[dict[int, mx.array]] = []

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        index = next(i for i, layer in enumerate(layers) if layer is self)
        if index == 0:
            forwards.append({})
        forwards[-1][index] = out[0] if isinstance(out, tuple) else out
        return out

    with monkeypatch.context() as patch:
        patch.setattr(cls, "__call__", spy)
        yield forwards


@contextmanager
def evaluated(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[mx.array]]]:
    """The arrays each ``mx.async_eval`` is handed (the runner's evaluation of
    a feed), left unevaluated for the test to read their graph."""
    calls: list[list[mx.array]] = []

    def spy(*arrays: Any) -> None:
        calls.append([a for item in arrays for a in (item if isinstance(item, list) else [item])])

    with monkeypatch.context() as patch:
        patch.setattr(mx, "async_eval", spy)
        yield calls


def _computed(forward: dict[int, mx.array], outputs: list[mx.array]) -> list[int]:
    return [i for i, out in sorted(forward.items()) if _in_graph(outputs, out)]


def test_a_chunk_without_logits_stops_at_the_last_state_write(
    family: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, last_writer = family
    runner.reset()
    runner.prefill_chunk(list(range(10, 40)), 0, logits=False)
    with recorded(runner, monkeypatch) as forwards, evaluated(monkeypatch) as calls:
        runner.prefill_chunk(list(range(40, 64)), 30, logits=False)
    (forward,) = forwards
    (outputs,) = calls
    assert _computed(forward, outputs) == list(range(last_writer))
    mx.eval(outputs)


def test_the_last_chunk_runs_every_layer_for_its_last_token_alone(
    family: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, last_writer = family
    runner.reset()
    runner.prefill_chunk(list(range(10, 40)), 0, logits=False)
    with recorded(runner, monkeypatch) as forwards, evaluated(monkeypatch) as calls:
        logits = runner.prefill_chunk(list(range(40, 64)), 30, logits=True)
    assert logits is not None and logits.shape == (VOCAB,)
    (outputs,) = calls
    others, last = forwards
    assert _computed(others, outputs) == list(range(last_writer))
    assert all(out.shape[1] == 1 for out in last.values())
    assert _computed(last, outputs) == sorted(last)
    mx.eval(outputs)


def test_a_batched_prefill_group_does_the_same(
    family: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sessions with histories of their own, merged, fed 12 tokens each as
    the engine's prefill group feeds them (``Runner.forward_batch``)."""
    runner, last_writer = family
    runner.reset()
    sessions = [runner.checkout() for _ in range(2)]
    try:
        for i, session in enumerate(sessions):
            runner.feed(session, list(range(10 + i, 30)), 0)
        state = runner.merge_states(sessions)
        for component in state.values():
            component.prepare(12)
        tokens = mx.array([list(range(50, 62)), list(range(70, 82))], dtype=mx.int32)
        with recorded(runner, monkeypatch) as forwards:
            logits = runner.forward_batch(tokens, [20, 19], state)
        outputs = [logits, *(a for component in state.values() for a in component.arrays())]
        others, last = forwards
        assert _computed(others, outputs) == list(range(last_writer))
        assert _computed(last, outputs) == sorted(last)
        mx.eval(outputs)
    finally:
        for session in sessions:
            runner.checkin(session)
        runner.forget_sessions()


def test_a_windowed_layer_fetches_only_the_rows_its_queries_see() -> None:
    """A sliding-window layer keeps rewind headroom past its window; a chunk's
    attention fetches only the ``window - 1`` rows before its first query
    (the rest would be masked out), and its mask covers exactly those."""
    window, chunk = 16, 10
    kv = LayerKV(window=window, headroom=window)
    rows = lambda n: mx.ones((1, 2, n, 4))  # noqa: E731
    kv.update_and_fetch(rows(100), rows(100))
    keys, _, key_start = kv.update_and_fetch(rows(chunk), rows(chunk))
    assert keys.shape[2] == window - 1 + chunk
    assert key_start == 100 - (window - 1)
    mask = kv.mask(chunk, key_start, keys.shape[2])
    assert isinstance(mask, mx.array)
    assert mask[0].tolist() == [True] * window + [False] * (chunk - 1)
    assert mask.sum(axis=1).tolist() == [window] * chunk
