"""One copy of every weight: the load, its warm-up and the first steps hold no second one.

A layer's stacked projections (:func:`~turbospark.layers.stacked.stacked`:
q/k/v, the MLP's gate and up) are concatenated once and the modules
re-pointed at their rows, so each weight is held once, as long as nothing
else still holds the arrays the stack was built from. Where the attention
kernels run, the runner's warm-up builds every stack inside
:meth:`Runner.open <turbospark.generation.runner.Runner.open>`; the loaded
tensors' dict, had it lived there too, would have kept each original beside
its stack: the load's peak grew by every stacked weight's bytes (on an H100,
bench's tp8b gemma4 in bf16: 33.33 GB, its 20.80 GB of weights and 12.48 GB
of q/k/v, gate and up rows).

The kernels' path is taken on the CPU with their contract in ops (as
``tests/test_attention_kernel_path.py`` does), on a gemma4 whose MLP
dominates its weights (float32 and 4-bit) and on a qwen_gdn (its gated
DeltaNet layers stack four input projections). Each bound is the same work run
again once the stacks exist, plus the one transient a stack's build is
allowed: its own bytes (the concatenation beside the parts it is made of),
and at 4 bits one product's weight in float (the CPU's many-row products
multiply it dequantized, and when MLX frees it varies between runs).
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from turbospark.generation.runner import Runner
from turbospark.layers import stacked as stacked_mod
from turbospark.layers.cuda import attention as attention_cuda
from turbospark.layers.cuda import norm as norm_cuda
from turbospark.loading.install import build_synthetic_install
from turbospark.loading.quantization import QuantSpec

# Wide MLPs: the gate and up rows are most of the weights, so a second copy
# of them stands far above the forwards' own transients.
WIDE = {"num_layers": 4, "hidden_size": 128, "intermediate_size": 2048}
INSTALLS = {
    "gemma4": ("gemma4", {**WIDE, "sliding_window": 8}, None),
    "gemma4-q4": ("gemma4", {**WIDE, "sliding_window": 8}, QuantSpec(bits=4, group_size=32)),
    "qwen_gdn": ("qwen_gdn", WIDE, None),
}
PROMPT = [3 + (7 * i) % 90 for i in range(40)]
CONTEXT = 256


@pytest.fixture(scope="module", params=list(INSTALLS))
def install(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, dims, quantize = INSTALLS[request.param]
    path = tmp_path_factory.mktemp(f"load-memory-{request.param}")
    build_synthetic_install(
        family, path, vocab_size=128, model_id=path.name, quantize=quantize, **dims
    )
    return path


@pytest.fixture(autouse=True)
def _collected() -> None:
    """No earlier test's runner left to be freed inside a measurement."""
    gc.collect()


def _kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention and norm kernels' path, their contract in ops: the warm-up
    at load runs (and builds every stack) as it does on a GPU."""
    monkeypatch.setattr(attention_cuda, "available", lambda: True)
    monkeypatch.setattr(attention_cuda, "decode", attention_cuda.decode_ops)
    monkeypatch.setattr(attention_cuda, "decode_step", mx.compile(attention_cuda.decode_ops))
    monkeypatch.setattr(norm_cuda, "available", lambda: True)
    monkeypatch.setattr(norm_cuda, "join_norm", norm_cuda.join_norm_ops)


def _stacks(model: nn.Module) -> Iterator[stacked_mod.Stacked]:
    for module in model.modules():
        yield from module.__dict__.get("_stacks", {}).values()


def _stack_bytes(stack: stacked_mod.Stacked) -> int:
    """The bytes one stack holds: its weight (packed: with scales and biases), its bias."""
    arrays = [stack.weight, stack.bias]
    if isinstance(stack.weight_t, stacked_mod.Packed):
        arrays += [stack.weight_t.scales, stack.weight_t.biases]
    return sum(a.nbytes for a in arrays if a is not None)


def _dequantized_bytes(model: nn.Module) -> int:
    """The most float weight one packed product holds on the CPU while it
    runs (:func:`~turbospark.layers.stacked.dequantizes`: many rows multiply
    a piece of the weight dequantized; 0 for a float model). MLX may finish
    one such piece before or after another transient, so a peak may hold it
    beside what a second run's did not."""
    shapes = [
        stack.weight_t.columns * stack.weight_t.scales.shape[-1] * stack.weight_t.group_size
        for module in model.modules()
        for stack in module.__dict__.get("_stacks", {}).values()
        if isinstance(stack.weight_t, stacked_mod.Packed)
    ]
    shapes += [
        module.weight.shape[0] * module.scales.shape[-1] * module.group_size
        for module in model.modules()
        if type(module) is nn.QuantizedLinear
    ]
    return min(4 * max(shapes, default=0), stacked_mod.CPU_DEQUANTIZE_PIECE_BYTES)


def _peak(run: Callable[[], object]) -> int:
    """MLX's peak active memory over *run*, above its active memory before."""
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    run()
    return mx.get_peak_memory() - before


def _first_steps(runner: Runner) -> None:
    """A prompt in one chunk, then three greedy decode steps."""
    runner.reset()
    token = int(mx.argmax(runner.prefill_chunk(PROMPT, 0, logits=True)).item())
    for i in range(3):
        token = int(mx.argmax(runner.produce(token, len(PROMPT) + i)).item())


def test_the_warm_up_at_load_holds_no_second_copy(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the kernels' path the load's peak (open, its warm-up building every
    stack) is at most the weights, the warm-up's own transient (the warm-up
    again, its stacks built), one stack's bytes (the build's transient) and,
    quantized, one product's weight dequantized (:func:`_dequantized_bytes`)."""
    _kernel_path(monkeypatch)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    runner = Runner.open(install, context_length=CONTEXT)
    opened_peak = mx.get_peak_memory() - before
    weights = mx.get_active_memory() - before
    stacks = [_stack_bytes(stack) for stack in _stacks(runner.model)]
    assert len(stacks) >= 6  # every layer's gate and up, each K/V owner's projections
    # Resident: the parameters (views of the stacks) and, less than one stack,
    # what is derived beside them (joint norm weights, RoPE's frequencies, the
    # traces' constants).
    params = sum(a.nbytes for _, a in tree_flatten(runner.model.parameters()))
    assert 0 <= weights - params < max(stacks)
    again = _peak(runner.warm_up)
    dense = _dequantized_bytes(runner.model)
    assert opened_peak <= weights + again + max(stacks) + dense, (
        f"the load peaked {(opened_peak - weights - again) / 1e6:.2f} MB above the weights and "
        f"the warm-up's transient; one stack's build may take {max(stacks) / 1e6:.2f} MB, "
        f"every stack's copy is {sum(stacks) / 1e6:.2f} MB"
    )


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel-path", "plain"])
def test_each_stack_is_built_once_and_the_first_steps_peak_as_later_ones(
    install: Path, monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    """Over the load, a prompt and decode steps, then the same again, each
    stack is built once; the first prompt and steps (on the plain path they
    build the stacks) peak no higher than the same steps again plus one
    stack's bytes, and leave resident no stack's worth beside the session."""
    if kernel:
        _kernel_path(monkeypatch)
    builds: Counter[tuple[int, ...]] = Counter()
    build = stacked_mod.Stacked.__init__

    def counted(stack: stacked_mod.Stacked, linears: list[nn.Module]) -> None:
        builds[tuple(map(id, linears))] += 1
        build(stack, linears)

    monkeypatch.setattr(stacked_mod.Stacked, "__init__", counted)
    runner = Runner.open(install, context_length=CONTEXT)
    loaded = mx.get_active_memory()
    first = _peak(lambda: _first_steps(runner))
    resident = mx.get_active_memory() - loaded
    again = _peak(lambda: _first_steps(runner))
    stacks = [_stack_bytes(stack) for stack in _stacks(runner.model)]
    assert set(builds.values()) == {1} and len(builds) == len(stacks) >= 6, builds
    assert first <= again + max(stacks) + _dequantized_bytes(runner.model)
    # Beside the session, less than one stack: what is derived at first use.
    assert resident - runner.store.live.nbytes < max(stacks)
