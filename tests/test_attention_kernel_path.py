"""A decode step's attention through the CUDA kernels' path equals the plain path, on the CPU.

On MLX's CUDA backend a lone row's decode step hands
:mod:`turbospark.layers.cuda.attention` a cache's whole buffers and the rows
its query attends over (:class:`~turbospark.layers.cuda.attention.Rows`, which
KV-shared layers reuse), and the kernels run traced once per buffer size. The
CUDA source runs only on a GPU (``tests/test_attention_cuda.py``); here the
kernels are replaced by their contract in ops
(:func:`~turbospark.layers.cuda.attention.decode_ops`), so what the layers
hand over (a window's first row, rows after a trim, a buffer that grew, a
rewind after a rejected draft, the KV-shared tail, qwen_gdn's MTP head) is
checked against the plain path wherever the suite runs. Float32 on CPU.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import (
    assert_states_close,
    batched_greedy,
    chunks_and_steps,
    engine_arrivals,
    greedy_both_paths,
    host_made_sizes,
    kind_install,
    mtp_drafts_both_paths,
    state_arrays,
)
from turbospark.generation.runner import Runner
from turbospark.layers import attention
from turbospark.layers.cuda import attention as attention_cuda
from turbospark.layers.cuda import norm as norm_cuda

PROMPT = [3 + (7 * i) % 90 for i in range(37)]
# MLX's attention over the same rows either way: only the path that hands them over differs.
ATOL = 1e-5
# gemma4 with a window of 8, per-layer inputs and two KV-shared layers; qwen_gdn
# (gated DeltaNet and attention layers) with its MTP head.
KINDS = {
    "gemma4": ("gemma4", {"num_layers": 4, "sliding_window": 8}),
    # The same with the norm kernels' forms too, as on a GPU (their contract in ops).
    "gemma4-norms": ("gemma4", {"num_layers": 4, "sliding_window": 8}),
    "qwen_gdn": ("qwen_gdn", {"num_layers": 4, "mtp": True}),
}


@pytest.fixture(scope="module", params=list(KINDS))
def install(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kind_install(
        tmp_path_factory.mktemp(f"attention-{request.param}"), *KINDS[request.param]
    )


@pytest.fixture(autouse=True)
def _norm_forms(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """For a ``-norms`` kind, both paths take the norm kernels' forms
    (:mod:`~turbospark.layers.cuda.norm`, in ops): layers hand their last
    join on unjoined, as they do on a GPU."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and str(callspec.params.get("install", "")).endswith("-norms"):
        monkeypatch.setattr(norm_cuda, "available", lambda: True)
        monkeypatch.setattr(norm_cuda, "join_norm", norm_cuda.join_norm_ops)


Handed = list[tuple[int, int, list[int] | None]]


def _path(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> Handed:
    """Take the kernels' path (with their ops) or the plain one; the rows each
    step's layers were handed to attend over (each K/V-owning layer's, in
    order: KV-shared layers reuse them), with a batch's rows' first columns."""
    handed: Handed = []

    class Rows(attention_cuda.Rows):
        def __init__(self, start: int, stop: int, left: mx.array | None = None):
            handed.append((start, stop, None if left is None else left.tolist()))
            super().__init__(start, stop, left)

    monkeypatch.setattr(attention_cuda, "available", lambda: kernel)
    monkeypatch.setattr(attention_cuda, "Rows", Rows)
    # Gemma 4's layers call the kernels inside their own traces, other families' through decode_step.
    monkeypatch.setattr(attention_cuda, "decode", attention_cuda.decode_ops)
    monkeypatch.setattr(attention_cuda, "decode_step", mx.compile(attention_cuda.decode_ops))
    return handed


def _open(path: Path, **kwargs) -> Runner:
    return Runner.open(path, context_length=1024, dtype="float32", **kwargs)


def _close(a: mx.array, b: mx.array, what: str) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL, rtol=ATOL, err_msg=what)


def test_chunks_and_steps_equal_the_plain_path(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uneven chunks, then three decode steps: every forward's logits and every
    state array at the end; the steps, and only they, took the kernels."""
    runs = []
    for kernel in (False, True):
        handed = _path(monkeypatch, kernel)
        runner = _open(install)
        handed.clear()  # the load's warm-up (Runner.warm_up): a scratch state's rows
        runs.append(chunks_and_steps(runner, PROMPT))
    (ref_logits, ref_state), (got_logits, got_state) = runs
    for i, (a, b) in enumerate(zip(got_logits, ref_logits, strict=True)):
        _close(a, b, f"forward {i}'s logits")
    assert_states_close(got_state, ref_state, ATOL)
    assert handed and all(stop - start <= len(PROMPT) + 3 for start, stop, _ in handed)


def test_steps_across_a_trim_and_a_grown_buffer(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt that ends two rows before the buffers' first 256, then steps
    past it (the buffers grow; the windowed layers drop the rows their window
    no longer reaches, so their rows start past 0): the logits of every step."""
    prompt = [3 + (5 * i) % 97 for i in range(254)]
    runs = []
    for kernel in (False, True):
        handed = _path(monkeypatch, kernel)
        runner = _open(install)
        handed.clear()  # the load's warm-up: a scratch state's rows
        runner.prefill_chunk(prompt, 0)
        steps = [runner.produce(5 + i, len(prompt) + i) for i in range(5)]
        runs.append((steps, state_arrays(runner.sessions()[0].state)))
    (ref_steps, ref_state), (got_steps, got_state) = runs
    for i, (a, b) in enumerate(zip(got_steps, ref_steps, strict=True)):
        _close(a, b, f"step {i}")
    assert_states_close(got_state, ref_state, ATOL)
    if "gemma4" in install.name:
        assert any(start > 0 for start, _, _ in handed), "no windowed layer's rows started past 0"


def test_batched_steps_equal_the_plain_path(install: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sessions of ragged lengths merged (left-padded), then batched
    greedy steps past the buffers' first growth (the windowed layers drop the
    columns no window reaches, so their rows start past 0, past the padding
    or not): every step's logits; the kernels' path took each step's
    attention with each row's first column."""
    prompts = [PROMPT[:5], PROMPT, [3 + (5 * i) % 97 for i in range(21)]]
    steps = 260  # the merged buffers hold the longest prompt and 256 more
    runs = []
    for kernel in (False, True):
        handed = _path(monkeypatch, kernel)
        runner = _open(install, session_slots=3)
        handed.clear()  # the load's warm-up: a lone row's steps
        runs.append(batched_greedy(runner, prompts, steps))
    for i, (a, b) in enumerate(zip(runs[1], runs[0], strict=True)):
        _close(a, b, f"step {i}")
    lefts = [left for _, _, left in handed]
    assert len(lefts) >= steps and all(left is not None for left in lefts)
    assert [32, 0, 16] in lefts  # the first step's padding before any column was dropped


def test_rows_joining_and_leaving_a_batch_equal_the_plain_path(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's batch as a server runs it: rows join a running batch
    (its padding grows) and leave it (the rest keep theirs), greedy, token for
    token against the plain path; batched steps took the kernels."""
    prompts = [PROMPT[:7], PROMPT[:3], PROMPT, PROMPT[5:15], PROMPT[:2]]
    arrivals, lengths = [0, 0, 1, 3, 4], [12, 5, 9, 1, 7]
    runs = []
    for kernel in (False, True):
        handed = _path(monkeypatch, kernel)
        runner = _open(install, session_slots=4)
        runs.append(engine_arrivals(runner, install, prompts, arrivals, lengths))
    assert runs[1] == runs[0]
    assert [len(tokens) for tokens in runs[0]] == lengths
    assert any(left is not None for _, _, left in handed), "no batched step took the kernels"


def test_greedy_output_equals_the_plain_path(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temperature 0, token for token: plain, the kernels' path, and the
    kernels' path with a drafter (its rejected drafts rewind the caches, and
    the next step attends over the rows left)."""
    plain, kernels, drafted = greedy_both_paths(install, partial(_path, monkeypatch), _open, PROMPT)
    assert kernels == plain == drafted


def test_the_mtp_head_drafts_as_on_the_plain_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen_gdn's MTP head keeps a cache of its own: the drafted output and the
    draft statistics match."""
    take = partial(_path, monkeypatch)
    runs = mtp_drafts_both_paths(tmp_path / "mtp", KINDS["qwen_gdn"][1], take, _open, PROMPT)
    assert runs[0] == runs[1]


def test_the_layer_step_sees_replaced_weights_and_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 4's layer step keeps the weights it derived between steps
    (``LayerEnd.step_weights``). A model that decoded, then took another
    checkpoint's weights, steps as that checkpoint does; then one model's
    down projection is replaced by a new module and the other's weight by a
    new array, the same values: both step alike, and unlike before."""
    _path(monkeypatch, True)
    dims = KINDS["gemma4"][1]
    reused, fresh = (
        _open(kind_install(tmp_path / name, "gemma4", {**dims, "seed": seed}))
        for name, seed in (("a", 1), ("b", 2))
    )
    for runner in (reused, fresh):  # both derive their step's weights
        runner.prefill_chunk(PROMPT, 0)
        runner.produce(5, len(PROMPT))
    reused.model.update(fresh.model.parameters())

    def step() -> tuple[mx.array, mx.array]:
        for runner in (reused, fresh):
            runner.reset()
            runner.prefill_chunk(PROMPT, 0)
        return reused.produce(5, len(PROMPT)), fresh.produce(5, len(PROMPT))

    got, want = step()
    _close(got, want, "after the weights were replaced")
    layer = 1  # owns its K/V (the last two of four share)
    weight = fresh.model.model.layers[layer].mlp.down_proj.weight[::-1] + 0  # outputs permuted
    module = nn.Linear(*reversed(weight.shape), bias=False)
    module.weight = weight
    reused.model.model.layers[layer].mlp.down_proj = module
    fresh.model.model.layers[layer].mlp.down_proj.weight = weight
    permuted, also = step()
    _close(permuted, also, "after a module and a weight were replaced")
    assert not np.allclose(np.array(permuted), np.array(got), atol=1e-3)


def test_a_steps_host_made_arrays_fit_the_small_pool(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a Gemma 4 layer step makes on the host each step (the RoPE
    offset, the rows attended, the row written) is at most eight bytes:
    MLX's CUDA allocator serves that from its small pool, while a larger
    array reuses a buffer the GPU last used and its write migrates the page
    back (138 µs an array on the H200)."""
    if "gemma4" not in install.name:
        pytest.skip("the layer step is Gemma 4's")
    _path(monkeypatch, True)

    sizes = host_made_sizes(monkeypatch)
    runner = _open(install)
    runner.prefill_chunk(PROMPT, 0)
    runner.produce(5, len(PROMPT))
    assert sizes and max(sizes) <= 8, sizes


def test_only_a_lone_rows_step_takes_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several queries (a chunk, a verify pass) keep the plain path, and so
    do a shape past the kernels' registers and keys of another dtype."""
    _path(monkeypatch, True)
    one = mx.zeros((1, 8, 1, 256))
    assert attention.takes_kernels(one, mx.zeros((1, 2, 1, 256)), mx.zeros((1, 2, 1, 256)))
    assert not attention.takes_kernels(
        mx.zeros((1, 8, 4, 256)), mx.zeros((1, 2, 4, 256)), mx.zeros((1, 2, 4, 256))
    )
    wide = mx.zeros((1, 64, 1, 512))  # 64 query heads on one key head of 512
    assert not attention.takes_kernels(wide, mx.zeros((1, 1, 1, 512)), mx.zeros((1, 1, 1, 512)))
    bf16 = mx.zeros((1, 2, 1, 256), dtype=mx.bfloat16)
    assert not attention.takes_kernels(one, bf16, bf16)


@given(capacity=st.integers(1, 1 << 20), max_splits=st.integers(1, 2048))
def test_chunks_cover_the_buffers_in_at_most_max_splits(capacity: int, max_splits: int) -> None:
    """The kernels' chunking (the partial kernel computes the same from its
    keys' shape): chunks of at least CHUNK keys in CHUNK's steps cover the
    buffers in at most MAX_SPLITS chunks, each holding a key, and stay CHUNK
    wherever that fits."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_cuda, "MAX_SPLITS", max_splits)
        chunk = attention_cuda.chunk_keys(capacity)
    splits = -(-capacity // chunk)
    assert chunk % attention_cuda.CHUNK == 0
    assert splits <= max_splits
    assert (splits - 1) * chunk < capacity <= splits * chunk
    if capacity <= attention_cuda.CHUNK * max_splits:
        assert chunk == attention_cuda.CHUNK
