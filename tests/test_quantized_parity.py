"""Quantized checkpoints against mlx-lm, on every path, for every family mlx-lm has.

The matrix: gemma4 (dense), gemma4 with routed experts, and qwen_gdn (its
head untied and tied to the packed embedding); 4-bit (groups of 32) and 8-bit
(groups of 64, which leaves gemma4's 96-wide down projections in floating
point: a mixed checkpoint) affine; written by
``mlx_lm.convert -q`` and imported as it is, or written by our converter
(``turbospark import --quantize``). On each checkpoint mlx-lm's own model
(``mlx_lm.utils.load_model`` on the same directory, so for our converter's
output this also proves mlx-lm loads it) gives the reference logits, and ours
must equal them within 1e-4 (float32, CPU) fed token by token, in chunks, as
rows of one batched forward, and through drafted verify passes that are cut
back; our greedy replies (plain, n-gram drafted, replayed drafts that are
sometimes wrong) must be mlx-lm's greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from quantized_checkpoints import MLX_LM_FAMILIES, VOCAB, mlx_lm_convert, our_convert, source

from turbospark import Runner
from turbospark.generation.drafters import ReplayDrafter
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.loading.importer import import_checkpoint
from turbospark.loading.install import load_weights, peek_manifest_arch, read_manifest
from turbospark.loading.plugins import family_hooks
from turbospark.loading.quantization import QuantSpec, quantization_of
from turbospark.policies import DraftPolicies
from turbospark.state.components import State
from turbospark.text import load_text

ATOL = 1e-4
SPECS = {4: QuantSpec(bits=4, group_size=32), 8: QuantSpec(bits=8, group_size=64)}
WRITERS = ("mlx_lm", "ours")
# 30 tokens: past gemma4's sliding window of 8 and over a GDN chunk boundary in pieces.
TOKENS = np.random.default_rng(7).integers(0, VOCAB, 30).tolist()
OTHER = np.random.default_rng(8).integers(0, VOCAB, 30).tolist()
CHUNKS = [7, 9, 14]
REPLY = 12

Case = tuple[Path, Any]  # (our install, mlx-lm's model of the same checkpoint)


# The fast loop keeps two corners of the matrix; the rest is slow-marked.
FAST = {("qwen_gdn", 4, "ours"), ("gemma4_moe", 4, "mlx_lm")}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            (n, b, w),
            id=f"{n}-{b}bit-{w}",
            marks=() if (n, b, w) in FAST else pytest.mark.slow,
        )
        for n in MLX_LM_FAMILIES
        for b in SPECS
        for w in WRITERS
    ],
)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    name, bits, writer = request.param
    root = tmp_path_factory.mktemp(f"{name}-{bits}-{writer}")
    src = source(name, root / "src")
    if writer == "mlx_lm":
        written = mlx_lm_convert(src, root / "mlx", SPECS[bits])
        install = root / "install"
        import_checkpoint(written, install, progress=False)
    else:
        written = install = our_convert(src, root / "install", SPECS[bits])
    model, _ = load_model(written)
    return install, model


def reference(model: Any, tokens: Sequence[int]) -> np.ndarray:
    """mlx-lm's logits at every position of *tokens*, one forward from scratch."""
    return np.array(model(mx.array(tokens)[None])[0].astype(mx.float32))


def ours(install: Path) -> tuple[Any, Any, Any]:
    arch = peek_manifest_arch(install)
    hook = family_hooks(arch.family)
    weights = load_weights(install, read_manifest(install))
    model = hook.turbospark_load_model(arch=arch, weights=weights, dtype=mx.float32, experts=None)
    assert quantization_of(model), "the install loaded in floating point"
    return arch, hook, model


def feed(install: Path, sizes: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    arch, hook, model = ours(install)
    state = hook.turbospark_new_state(arch=arch, model=model, context_length=128)
    rows, start = [], 0
    for size in sizes:
        piece = mx.array(tokens[start : start + size])
        out = hook.turbospark_forward(
            model=model,
            tokens=piece,
            start=start,
            state=state,
            vision=None,
            logits="all",
            steer=None,
        )
        rows.append(np.array(out))
        start += size
    return np.concatenate(rows)


def test_sequential(case: Case) -> None:
    install, model = case
    got = feed(install, [1] * len(TOKENS), TOKENS)
    np.testing.assert_allclose(got, reference(model, TOKENS), atol=ATOL)


def test_chunked(case: Case) -> None:
    install, model = case
    got = feed(install, CHUNKS, TOKENS)
    np.testing.assert_allclose(got, reference(model, TOKENS), atol=ATOL)


def test_batched(case: Case) -> None:
    """Two sessions at 11 and 19 tokens, merged, stepped together three times."""
    install, model = case
    arch, hook, ours_model = ours(install)
    histories = [TOKENS[:11], OTHER[:19]]
    full = [TOKENS, OTHER]
    states: list[State] = []
    for history in histories:
        state = hook.turbospark_new_state(arch=arch, model=ours_model, context_length=128)
        hook.turbospark_forward(
            model=ours_model,
            tokens=mx.array(history),
            start=0,
            state=state,
            vision=None,
            logits="none",
            steer=None,
        )
        states.append(state)
    batch = {name: type(c).merge([s[name] for s in states]) for name, c in states[0].items()}
    expected = [reference(model, seq) for seq in full]
    for step in range(3):
        positions = [len(h) + step for h in histories]
        tokens = [seq[p] for seq, p in zip(full, positions, strict=True)]
        for component in batch.values():
            component.prepare(1)
        out = hook.turbospark_forward_batch(
            model=ours_model,
            tokens=mx.array(tokens)[:, None],
            positions=positions,
            state=batch,
            logits="last",
            steer=None,
        )
        for row, (p, want) in enumerate(zip(positions, expected, strict=True)):
            np.testing.assert_allclose(np.array(out[row]), want[p], atol=ATOL)


def test_drafted_verify_passes(case: Case) -> None:
    """Verify passes of a confirmed token and drafts, cut back after each:
    every row of every pass is mlx-lm's on the same tokens."""
    install, model = case
    runner = Runner.open(install, context_length=128, dtype="float32")
    runner.verify(None, TOKENS[:12], 0)
    runner.accept(None, 0, 12)
    history = TOKENS[:12]
    rounds = [(TOKENS[12:17], 2), ([TOKENS[14], 3, 5, 7], 1), (TOKENS[15:19], 4)]
    for fed, keep in rounds:
        got = np.array(runner.verify(None, fed, len(history)))
        want = reference(model, [*history, *fed])[len(history) :]
        np.testing.assert_allclose(got, want, atol=ATOL)
        runner.accept(None, len(history), keep)
        history = [*history, *fed[:keep]]


def mlx_lm_greedy(model: Any, prompt: Sequence[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for (token, _), _ in zip(steps, range(n), strict=False)]


@pytest.mark.parametrize("drafting", ["plain", "ngram", "replayed"])
def test_greedy_replies(case: Case, drafting: str) -> None:
    install, model = case
    prompt = TOKENS[:16]
    expected = mlx_lm_greedy(model, prompt, REPLY)
    draft = DraftPolicies.ngram(min_match=1) if drafting == "ngram" else DraftPolicies.off()
    runner = Runner.open(install, context_length=128, dtype="float32", draft=draft)
    drafter = None
    if drafting == "replayed":  # drafts right about half the time
        drafter = ReplayDrafter([*prompt, *expected], runner.vocab_size, 3, accuracy=0.5, seed=1)
    config = GenerationConfig(max_tokens=REPLY, stop_token_ids=[])
    done = generate(runner, load_text(install), prompt, config, drafter)
    assert done.tokens == expected
