"""A long prompt's prefill holds a bounded share of its scratch, with the same logits.

Two ways of holding a forward's scratch, one prompt fed as one chunk through
the runner: every causal chunk's scores at once and every gated-delta chunk
prepared at once (the bounds lifted), against the bounds a long prompt meets
(:data:`~turbospark.layers.attention.BLOCK_SCORES`,
:data:`~turbospark.layers.gated_delta.rule.GROUP_TOKENS`, scaled down to this
model). The last token's logits must be the same, and the bounded peak well
under the other: the test fails if either bound stops taking effect.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from turbospark import build_synthetic_install
from turbospark.generation.runner import Runner
from turbospark.layers import attention
from turbospark.layers.gated_delta import rule

PROMPT = 1024
HEADS = 8


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    path: Path = tmp_path_factory.mktemp("qwen_gdn")
    # 8 layers: layer 3's attention feeds the layers after it, so a chunk computes it.
    build_synthetic_install(
        "qwen_gdn", path, vocab_size=128, num_layers=8, num_attention_heads=HEADS,
        num_key_value_heads=2, model_id="long-prompt-memory", seed=0,
    )  # fmt: skip
    return Runner.open(path, context_length=PROMPT + 8)


def _prefill(runner: Runner, prompt: list[int]) -> tuple[mx.array, int]:
    """The last token's logits and the peak bytes above what was held before."""
    runner.reset()
    mx.clear_cache()  # every buffer new: none a larger cached one
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    logits = runner.prefill_chunk(prompt, 0)
    assert logits is not None
    mx.eval(logits)
    return logits, mx.get_peak_memory() - base


def test_bounded_scratch_gives_the_same_logits_in_less_memory(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = [(i * 37) % 120 + 6 for i in range(PROMPT)]
    monkeypatch.setattr(attention, "BLOCK_SCORES", 1 << 40)
    monkeypatch.setattr(rule, "GROUP_TOKENS", 1 << 40)
    whole, whole_peak = _prefill(runner, prompt)
    # Scaled to this model: a block of 64 queries over the chunk, groups of 128 tokens.
    monkeypatch.setattr(attention, "BLOCK_SCORES", HEADS * PROMPT * 64)
    monkeypatch.setattr(rule, "GROUP_TOKENS", 128)
    bounded, bounded_peak = _prefill(runner, prompt)
    assert mx.allclose(bounded, whole, atol=1e-5).item()
    assert int(mx.argmax(bounded).item()) == int(mx.argmax(whole).item())
    assert bounded_peak < 0.6 * whole_peak, (bounded_peak, whole_peak)
