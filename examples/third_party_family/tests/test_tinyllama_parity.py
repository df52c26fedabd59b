"""tinyllama against mlx-lm's ``llama.py`` on the same install directory.

The install is a valid Hugging Face checkpoint, so ``mlx_lm.utils.load_model``
loads it unchanged; every prompt position's logits and a few decode steps
must match ours (float32, tight tolerance). A long prompt fed in uneven chunks
(past two of the K/V's 256-row blocks, chunk edges just before, on and after
each boundary) must match too: short prompts never regrow a buffer, and a
growth bug hides there. Copy these tests with the family.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turbospark import Runner, build_synthetic_install

mlx_lm_utils = pytest.importorskip("mlx_lm.utils", reason="mlx-lm is the parity oracle")
mlx_lm_cache = pytest.importorskip("mlx_lm.models.cache")

PROMPT = [1, 17, 42, 5, 9, 88, 3, 61, 27, 14, 70, 2, 33]
DECODE = [19, 4, 77]
ATOL = 1e-4


@pytest.mark.parametrize(
    "dims",
    [
        {"num_key_value_heads": 2},  # grouped-query attention, separate lm_head
        {"num_key_value_heads": 4, "tie_word_embeddings": True},  # one K/V per head, tied head
    ],
    ids=["gqa", "mha_tied"],
)
def test_matches_mlx_lm(tmp_path: Path, dims: dict[str, object]) -> None:
    build_synthetic_install("tinyllama", tmp_path, vocab_size=96, num_layers=2, **dims)
    reference, _ = mlx_lm_utils.load_model(tmp_path)
    cache = mlx_lm_cache.make_prompt_cache(reference)
    expected = reference(mx.array(PROMPT)[None], cache=cache)[0]  # (L, vocab)

    runner = Runner.open(tmp_path, dtype=mx.float32)
    for position, token in enumerate(PROMPT):
        ours = runner.produce(token, position)
        np.testing.assert_allclose(ours, expected[position], atol=ATOL, rtol=ATOL)
    chunked = Runner.open(tmp_path, dtype=mx.float32).prefill_chunk(PROMPT, 0)
    np.testing.assert_allclose(chunked, expected[-1], atol=ATOL, rtol=ATOL)

    for step, token in enumerate(DECODE):
        expected_step = reference(mx.array([[token]]), cache=cache)[0, -1]
        ours = runner.produce(token, len(PROMPT) + step)
        np.testing.assert_allclose(ours, expected_step, atol=ATOL, rtol=ATOL)


def test_mlx_lm_tokenizes_a_chat_exactly_as_we_do(tmp_path: Path) -> None:
    """Llama 3's byte-level tokenizer and chat template: mlx-lm (through
    ``transformers``) and turbospark give the same prompt tokens."""
    tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")
    from turbospark.sdk import load_text

    build_synthetic_install("tinyllama", tmp_path, vocab_size=128, num_layers=1)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there, how are you? 42 + 7 = 49."},
        {"role": "assistant", "content": " Good to hear it. "},
        {"role": "user", "content": "And the weather?"},
    ]
    theirs = tokenizer_utils.load(tmp_path).apply_chat_template(chat, add_generation_prompt=True)
    ours = load_text(tmp_path)
    assert ours.encode_chat(chat) == list(theirs)
    assert ours.decode(ours.encode_chat(chat), skip_special_tokens=False).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    )


# Chunk sizes of a 600-token prompt: edges at 250, 256 (a full block), 257 (its
# regrowth), 307, 506, 519 (across the second boundary at 512), then the rest.
LONG_CHUNKS = [250, 6, 1, 50, 199, 13, 81]


def test_long_uneven_chunked_prefill_matches_mlx_lm(tmp_path: Path) -> None:
    """Each uneven chunk's last logits, then a few decode steps, equal mlx-lm's
    one-chunk run of the same 600-token prompt."""
    build_synthetic_install("tinyllama", tmp_path, vocab_size=96, num_layers=2)
    prompt = [int(t) for t in np.random.default_rng(22).integers(0, 96, sum(LONG_CHUNKS))]
    reference, _ = mlx_lm_utils.load_model(tmp_path)
    cache = mlx_lm_cache.make_prompt_cache(reference)
    expected = reference(mx.array(prompt)[None], cache=cache)[0]  # (600, vocab)

    runner = Runner.open(tmp_path, dtype=mx.float32)
    start = 0
    for size in LONG_CHUNKS:
        ours = runner.prefill_chunk(prompt[start : start + size], start)
        start += size
        np.testing.assert_allclose(
            ours, expected[start - 1], atol=ATOL, rtol=ATOL, err_msg=f"after position {start - 1}"
        )
    for step, token in enumerate(DECODE):
        expected_step = reference(mx.array([[token]]), cache=cache)[0, -1]
        ours = runner.produce(token, len(prompt) + step)
        np.testing.assert_allclose(ours, expected_step, atol=ATOL, rtol=ATOL)
