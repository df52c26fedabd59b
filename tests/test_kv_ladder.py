"""K/V buffers grow on one fixed ladder of capacities, so a traced decode step never retraces per growth.

Where the attention kernels run, a lone row's decode step is traced with the
cache's whole buffers (:mod:`turbospark.layers.attention_step`): a new
capacity is a new trace. Here the kernels' path is taken on the CPU with
their contract in ops (as ``tests/test_attention_kernel_path.py`` does), and
the traces are counted where MLX runs a traced function's Python body: only
when it traces. A decode that crosses several growths traces nothing after
the runner's warm-up, and without it at most once per rung met; its logits
equal the plain path's.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import kind_install
from turbospark.generation.runner import Runner
from turbospark.layers import attention_step
from turbospark.layers.cuda import attention as attention_cuda
from turbospark.state.kv import FINE_UNTIL, PER_OCTAVE, STEP, LayerKV, capacity_for, ladder

PROMPT = [3 + (7 * i) % 90 for i in range(250)]
STEPS = 560  # from 250 past 256, 512 and 768 rows: three growths of the full layers
CONTEXT = 1024


def test_the_ladder_wastes_little_and_grows_by_a_step() -> None:
    """Every capacity is a rung; up to :data:`FINE_UNTIL` the rungs are
    mlx-lm's step-256 multiples, past it a rung is at most ``1/PER_OCTAVE``
    of itself beyond what it holds; and the rungs to 128k are few."""
    rungs = ladder(1 << 17)
    assert rungs == sorted(set(rungs)) and rungs[-1] == 1 << 17
    assert len(rungs) == FINE_UNTIL // STEP + 4 * PER_OCTAVE
    on_ladder = set(rungs)
    for rows in [*range(1, 3 * STEP), *range(FINE_UNTIL - 600, 1 << 17, 997)]:
        capacity = capacity_for(rows)
        assert capacity in on_ladder and capacity >= rows
        if rows <= FINE_UNTIL:
            assert capacity - rows < STEP
        else:
            assert capacity - rows < max(STEP, capacity / PER_OCTAVE)


def test_a_layer_grows_to_rungs_and_a_ring_keeps_one_capacity() -> None:
    """A full layer's buffers, fed in odd chunks and then a token at a time,
    only ever take rungs; a window's ring trims to one capacity and keeps it."""
    row = mx.zeros((1, 2, 1, 4))
    for layer in (LayerKV(), LayerKV(window=100, headroom=3)):
        seen = set()
        for length in (7, 300, 33):
            layer.update(mx.zeros((1, 2, length, 4)), mx.zeros((1, 2, length, 4)))
            seen.add(layer.keys.shape[2])
        for _ in range(1200):
            layer.update(row, row)
            seen.add(layer.keys.shape[2])
        assert seen <= set(ladder(4096))
        if layer.window is not None:
            assert layer.keys.shape[2] == capacity_for(layer.retain + STEP)


def test_a_decode_to_the_limit_stays_within_the_warmed_rungs() -> None:
    """Fed a token at a time up to a context limit, a full layer's buffers
    never take a capacity past the rungs the runner's warm-up traces."""
    row = mx.zeros((1, 1, 1, 4))
    for limit in (300, 512, 8192 + 300):
        layer, warmed = LayerKV(), set(ladder(limit + STEP))
        layer.update(mx.zeros((1, 1, 100, 4)), mx.zeros((1, 1, 100, 4)))
        while layer.fill < limit:
            layer.update(row, row)
            assert layer.keys.shape[2] in warmed


# gemma4: full layers, windowed ones (a window of 8) and KV-shared ones;
# qwen_gdn: an attention layer among gated-DeltaNet ones.
KINDS = {
    "gemma4": {"num_layers": 4, "sliding_window": 8},
    "qwen_gdn": {"num_layers": 4},
}


@pytest.fixture(scope="module", params=list(KINDS))
def install(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return kind_install(tmp_path_factory.mktemp(f"ladder-{family}"), family, KINDS[family])


Traces = Counter[tuple[str, tuple[int, ...]]]


def _kernel_path(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> Traces:
    """Take the kernels' path (their contract in ops) or the plain one, with
    the layer steps' traces counted by step and buffer shape."""
    traces: Traces = Counter()
    owner, shared = attention_step.owner_layer, attention_step.shared_layer

    def counted(body):
        def traced(inputs, stream, weights, start, keys, *rest):
            traces[body.__name__, keys.shape] += 1  # MLX runs the body only to trace it
            return body(inputs, stream, weights, start, keys, *rest)

        return traced

    monkeypatch.setattr(attention_step, "owner_layer", counted(owner))
    monkeypatch.setattr(attention_step, "shared_layer", counted(shared))
    for trace in (attention_step.owner_trace, attention_step.shared_trace):
        trace.cache_clear()  # traced anew from here: by the counted bodies
    monkeypatch.setattr(attention_cuda, "available", lambda: kernel)
    monkeypatch.setattr(attention_cuda, "decode", attention_cuda.decode_ops)
    monkeypatch.setattr(attention_cuda, "decode_step", mx.compile(attention_cuda.decode_ops))
    return traces


@pytest.fixture(autouse=True)
def _fresh_traces():
    yield
    attention_step.owner_trace.cache_clear()
    attention_step.shared_trace.cache_clear()


def _decode(runner: Runner) -> list[np.ndarray]:
    """The prompt, then greedy steps past three growths: every step's logits."""
    logits = runner.prefill_chunk(PROMPT, 0)
    out = []
    for i in range(STEPS):
        token = int(mx.argmax(logits).item())
        out.append(np.array(logits))
        logits = runner.produce(token, len(PROMPT) + i)
    return out


@pytest.mark.slow
def test_no_decode_step_traces_after_the_warm_up(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's load traces each (buffer shape) rung once; a decode
    across three growths then traces nothing, and its logits are the
    plain path's."""
    plain = _decode(Runner.open(install, context_length=CONTEXT, dtype="float32"))
    traces = _kernel_path(monkeypatch, True)
    runner = Runner.open(install, context_length=CONTEXT, dtype="float32")
    warmed = sum(traces.values())
    assert warmed and max(traces.values()) == 1, "a rung traced twice"
    assert {shape[2] for _, shape in traces} == set(ladder(CONTEXT + STEP))
    got = _decode(runner)
    assert sum(traces.values()) == warmed, f"decode traced {sum(traces.values()) - warmed}"
    assert runner.sessions()[0].state["kv"].layers[0].keys.shape[2] == 1024
    for i, (a, b) in enumerate(zip(got, plain, strict=True)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=f"step {i}")


@pytest.mark.slow
def test_without_the_warm_up_each_rung_traces_once(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the warm-up the steps trace once per buffer shape met (the
    rungs crossed, per kind of layer), and a second session over the same
    rungs traces nothing: never once per growth of a session."""
    monkeypatch.setattr(Runner, "warm_up", lambda self: 0)
    traces = _kernel_path(monkeypatch, True)
    runner = Runner.open(install, context_length=CONTEXT, dtype="float32")
    _decode(runner)
    assert max(traces.values()) == 1, "a buffer shape traced twice"
    assert {shape[2] for _, shape in traces} <= set(ladder(CONTEXT))
    first = sum(traces.values())
    runner.reset()
    _decode(runner)
    assert sum(traces.values()) == first
