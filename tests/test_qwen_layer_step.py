"""qwen_gdn's one-trace layer step equals the modules' path, on the CPU.

On MLX's CUDA backend a lone row's decode step runs each qwen_gdn layer as one
traced call (``DecoderLayer._layer_step``): a gated-DeltaNet layer with
:mod:`~turbospark.layers.cuda.gdn`'s decode kernel (core's
:func:`~turbospark.layers.gated_delta.step.gated_delta_layer_step`), a full-attention layer with
its cache's writes scattered in on the device and
:mod:`~turbospark.layers.cuda.attention`'s kernels. The CUDA sources run only
on a GPU (``tests/test_attention_cuda.py``, ``tests/test_gdn_cuda.py``); here
every kernel is replaced by its contract in ops, as the other kernel-path
tests do, and the layer step is compared with the modules' path over the same
kernels' forms: chunks then steps, steps across a grown buffer, greedy output
with and without drafting (verify passes keep the modules), the MTP head, and
replaced weights. Float32 on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from helpers import (
    assert_states_close,
    chunks_and_steps,
    greedy_both_paths,
    host_made_sizes,
    kind_install,
    mtp_drafts_both_paths,
    state_arrays,
)
from turbospark.generation.runner import Runner
from turbospark.layers import attention_step
from turbospark.layers.cuda import attention as attention_cuda
from turbospark.layers.cuda import gdn as gdn_cuda
from turbospark.layers.cuda import norm as norm_cuda
from turbospark.layers.gated_delta import step as gdn_step
from turbospark_qwen_gdn import model

PROMPT = [3 + (7 * i) % 90 for i in range(37)]
# The same ops either way but for the rows' shapes: float32 apart by rounding only.
ATOL = 1e-5
# Layers 0-2 gated DeltaNet, layer 3 full attention (every fourth), and the MTP head.
DIMS = {"num_layers": 4, "mtp": True}


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kind_install(tmp_path_factory.mktemp("qwen-layer-step"), "qwen_gdn", DIMS)


@pytest.fixture(params=["joined", "norms"])
def norms(request: pytest.FixtureRequest) -> bool:
    """Without and with the norm kernels' forms (in ops): with them, a layer
    hands its last join on unjoined, as on a GPU."""
    return request.param == "norms"


def _kernels(monkeypatch: pytest.MonkeyPatch, norms: bool) -> dict[str, int]:
    """Every kernel's forms as on a GPU, each in its ops; the count of layer
    steps of each kind taken."""
    monkeypatch.setattr(gdn_cuda, "available", lambda: True)
    monkeypatch.setattr(gdn_cuda, "gated_delta", gdn_cuda.gated_delta_ops)
    monkeypatch.setattr(gdn_cuda, "decode_mixer", gdn_cuda.decode_mixer_ops)
    monkeypatch.setattr(attention_cuda, "available", lambda: True)
    monkeypatch.setattr(attention_cuda, "decode", attention_cuda.decode_ops)
    monkeypatch.setattr(attention_cuda, "decode_step", mx.compile(attention_cuda.decode_ops))
    if norms:
        monkeypatch.setattr(norm_cuda, "available", lambda: True)
        monkeypatch.setattr(norm_cuda, "join_norm", norm_cuda.join_norm_ops)
    taken = {"linear": 0, "attention": 0}
    real_linear, real_owner = gdn_step.step_trace, attention_step.owner_trace

    def linear(*args: object) -> object:
        taken["linear"] += 1
        return real_linear(*args)

    def owner(inputs: object) -> Callable[..., object]:
        step = real_owner(inputs)  # type: ignore[arg-type]

        def counted(*args: object) -> object:
            taken["attention"] += 1
            return step(*args)

        return counted

    monkeypatch.setattr(gdn_step, "step_trace", linear)
    monkeypatch.setattr(attention_step, "owner_trace", owner)
    return taken


def _open(path: Path, **kwargs) -> Runner:
    return Runner.open(path, context_length=1024, dtype="float32", **kwargs)


def _close(a: mx.array, b: mx.array, what: str) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL, rtol=ATOL, err_msg=what)


def _switch(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """``take(on)``: the layer step on, or off (every layer runs its modules)."""
    real = model.DecoderLayer._layer_step

    def take(on: bool) -> None:
        monkeypatch.setattr(model.DecoderLayer, "_layer_step", real if on else lambda *a: None)

    return take


def _both(
    monkeypatch: pytest.MonkeyPatch, norms: bool, install: Path, run
) -> tuple[object, object, dict]:
    """``run(runner)`` over *install* with the modules' path, then with the
    layer step (each with every kernel's forms); both results and the layer
    steps *run* took (the runner's load steps too: ``Runner.warm_up``)."""
    out = []
    for on in (False, True):
        with monkeypatch.context() as patch:
            taken = _kernels(patch, norms)
            _switch(patch)(on)
            runner = _open(install)
            taken.update(linear=0, attention=0)
            out.append(run(runner))
    return out[0], out[1], taken


def test_chunks_and_steps_equal_the_modules(
    install: Path, norms: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uneven chunks, then three decode steps: every forward's logits and
    every state array at the end; the steps took the layer step, each layer
    kind once a step, and so did each chunk's last token (a chunk whose logits
    are read feeds its last token alone: six one-token forwards)."""
    want, got, taken = _both(monkeypatch, norms, install, partial(chunks_and_steps, prompt=PROMPT))
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        _close(a, b, f"forward {i}'s logits")
    assert_states_close(got[1], want[1], ATOL)
    assert taken == {"linear": 3 * 6, "attention": 6}


def test_steps_across_a_grown_buffer(
    install: Path, norms: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt that ends two rows before the cache's first 256, then five
    steps past it (the attention layer's buffers grow under the trace):
    every step's logits and the state."""
    prompt = [3 + (5 * i) % 97 for i in range(254)]

    def run(runner: Runner) -> tuple[list[mx.array], dict]:
        runner.prefill_chunk(prompt, 0)
        steps = [runner.produce(5 + i, len(prompt) + i) for i in range(5)]
        return steps, state_arrays(runner.sessions()[0].state)

    want, got, _ = _both(monkeypatch, norms, install, run)
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        _close(a, b, f"step {i}")
    assert_states_close(got[1], want[1], ATOL)


def test_greedy_output_equals_the_modules(
    install: Path, norms: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temperature 0, token for token: the modules, the layer step, and the
    layer step with a drafter (verify passes run the modules; rejected drafts
    rewind the caches and the GDN states the next steps start from)."""
    _kernels(monkeypatch, norms)
    plain, stepped, drafted = greedy_both_paths(install, _switch(monkeypatch), _open, PROMPT)
    assert stepped == plain == drafted


def test_the_mtp_head_drafts_as_with_the_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MTP head's attention layer takes the layer step too, over its
    own cache: the drafted output and the draft statistics match."""
    _kernels(monkeypatch, True)
    runs = mtp_drafts_both_paths(tmp_path / "mtp", DIMS, _switch(monkeypatch), _open, PROMPT)
    assert runs[0] == runs[1]


def test_the_layer_step_sees_replaced_weights_and_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer step keeps the weights it derived between steps
    (``LayerEnd.step_weights``). A model that decoded, then took another
    checkpoint's weights, steps as its modules do; so it does after each
    replacement in both layer kinds, of a projection by a new module or of a
    weight by a new array (rows permuted: the output changes each time)."""
    _kernels(monkeypatch, True)
    runner, other = (
        _open(kind_install(tmp_path / name, "qwen_gdn", {**DIMS, "seed": seed}))
        for name, seed in (("a", 1), ("b", 2))
    )
    take = _switch(monkeypatch)

    def step(on: bool) -> mx.array:
        take(on)
        runner.reset()
        runner.prefill_chunk(PROMPT, 0)
        return runner.produce(5, len(PROMPT))

    before = step(True)  # the layers derive their step's weights
    runner.model.update(other.model.parameters())
    got = step(True)
    _close(got, step(False), "after the weights were replaced")
    layers = runner.model.model.layers
    for layer, (owner, name), as_module in (
        (1, ("linear_attn", "out_proj"), True),
        (2, ("linear_attn", "in_proj_z"), False),
        (3, ("self_attn", "o_proj"), False),
        (3, ("mlp", "down_proj"), True),
    ):
        held = layers[layer][owner]
        weight = held[name].weight[::-1] + 0  # outputs permuted
        if as_module:
            held[name] = nn.Linear(*reversed(weight.shape), bias=False)
        held[name].weight = weight
        before, got = got, step(True)
        _close(got, step(False), f"after layer {layer}'s {owner}.{name} was replaced")
        assert not np.allclose(np.array(got), np.array(before), atol=1e-3)


class Wrapped(nn.Module):
    """A projection that is not a plain ``nn.Linear`` and has no ``weight``
    of its own (as an adapter or a sharded wrapper may be)."""

    def __init__(self, inner: nn.Linear):
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x)


def test_a_wrapped_projection_falls_back_to_the_modules(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer whose projection is wrapped takes the modules' path, with the
    same output; the other layers keep the layer step."""
    taken = _kernels(monkeypatch, True)
    runner = _open(install)
    runner.prefill_chunk(PROMPT, 0)
    want = runner.produce(5, len(PROMPT))  # every layer derives its step's weights
    mixer = runner.model.model.layers[1]["linear_attn"]
    mixer["out_proj"] = Wrapped(mixer["out_proj"])
    runner.reset()
    runner.prefill_chunk(PROMPT, 0)
    before = dict(taken)
    _close(runner.produce(5, len(PROMPT)), want, "with layer 1's out_proj wrapped")
    assert taken["linear"] - before["linear"] == 2  # layers 0 and 2


def test_a_steps_host_made_arrays_fit_the_small_pool(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an attention layer's step takes from the host each step (the RoPE
    offset, the rows attended, the row written) is at most
    eight bytes: MLX's CUDA allocator serves that from its small pool, so no
    write migrates a page the GPU last used back to the host."""
    _kernels(monkeypatch, True)
    sizes = host_made_sizes(monkeypatch)
    runner = _open(install)
    runner.prefill_chunk(PROMPT, 0)
    runner.produce(5, len(PROMPT))
    assert sizes and max(sizes) <= 8, sizes
