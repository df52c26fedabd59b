"""A decode step's graph holds no more nodes than it needs.

Each graph node (a view too) costs host time to build, replay and schedule,
and a lone row's decode step on a GPU is bound by that host time. These tests
count the primitives MLX exports for one step (its sample and the state
writes included), a lone row's and a batch's, and hold each at or below what
it takes now, so a node that comes back fails here (a lone row's step on
the CPU takes the modules' compiled path; the CUDA kernels' path is counted
by ``bench/gpu_kernels.py``). The values themselves
are held equal elsewhere (parity against mlx-lm, batched against alone).
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest

from turbospark import build_synthetic_install
from turbospark.generation.runner import Runner

PROMPT = [3, 9, 4, 17, 5, 11, 8, 2]
# Primitives of one lone row's decode step of a 4-layer synthetic install
# (float32, CPU): gemma4's with its per-layer inputs (PLE), two of its
# layers sharing K/V; qwen_gdn's three gated-DeltaNet layers and one attention.
CEILINGS = {"gemma4": 369, "qwen_gdn": 366}


@pytest.fixture(scope="module", params=sorted(CEILINGS))
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    build_synthetic_install(
        request.param, path, vocab_size=128, num_layers=4, model_id=f"nodes-{request.param}",
        seed=0,
    )  # fmt: skip
    opened = Runner.open(path, context_length=64)
    yield request.param, opened
    opened.close()


def primitives(arrays: list[mx.array]) -> Counter[str]:
    """The primitives of the unevaluated graph behind *arrays*, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "step.dot"
        mx.export_to_dot(str(dot), *arrays)
        return Counter(re.findall(r'label ="([^"]+)"', dot.read_text()))


def step_graph(runner: Runner) -> Counter[str]:
    """The primitives of one greedy decode step after :data:`PROMPT`, its
    sample and every state array included (nothing evaluated)."""
    runner.reset()
    runner.prefill_chunk(PROMPT, 0)
    live = runner.store.live
    logits = runner._hook.turbospark_forward(
        model=runner.model, tokens=mx.array([1], mx.int32), start=live.position,
        state=live.state, vision=None, logits="last", steer=None,
    )  # fmt: skip
    arrays = [mx.argmax(logits), *(a for c in live.state.values() for a in c.arrays())]
    counted = primitives(arrays)
    mx.eval(arrays)
    return counted


def test_lone_step_nodes(runner: tuple[str, Runner]) -> None:
    family, opened = runner
    step_graph(opened)  # traces the compiled functions
    counted = step_graph(opened)
    assert sum(counted.values()) <= CEILINGS[family], counted
