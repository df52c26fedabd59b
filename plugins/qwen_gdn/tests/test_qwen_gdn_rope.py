"""Multimodal RoPE: text-only (i, i, i) triples are plain RoPE, and distinct
(t, h, w) positions follow Hugging Face's interleaved recomposition."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from turbospark.sdk import (
    MropePositions,
    VisionInjection,
    VisionMap,
    build_synthetic_install,
    family_hooks,
    load_weights,
    peek_manifest_arch,
    read_manifest,
)
from turbospark_qwen_gdn.model import QwenGdnConfig, QwenRope

PROMPT = np.random.default_rng(5).integers(0, 128, 24).tolist()
DECODE = [7, 70, 100]


def _run(path: Path, vision: VisionMap | None) -> np.ndarray:
    hook = family_hooks("qwen_gdn")
    arch = peek_manifest_arch(path)
    model = hook.turbospark_load_model(
        arch=arch, weights=load_weights(path, read_manifest(path)), dtype=mx.float32, experts=None
    )
    state = hook.turbospark_new_state(arch=arch, model=model, context_length=256)
    rows, start = [], 0
    for piece in [PROMPT[:10], PROMPT[10:], *([t] for t in DECODE)]:
        out = hook.turbospark_forward(
            model=model,
            tokens=mx.array(piece),
            start=start,
            state=state,
            vision=vision,
            logits="all",
            steer=None,
        )
        rows.append(np.array(out))
        start += len(piece)
    return np.concatenate(rows)


def test_text_only_triples_equal_no_vision(tmp_path: Path) -> None:
    """(i, i, i) triples, and injected embeddings equal to the tokens' own, change
    nothing — including decode steps past the prompt (rope_delta 0)."""
    arch = build_synthetic_install("qwen_gdn", tmp_path, vocab_size=128, model_id="tiny", seed=6)
    plain = _run(tmp_path, None)
    embed = mx.load(str(tmp_path / "model.safetensors"))["model.language_model.embed_tokens.weight"]
    injection = VisionInjection(start=4, embeddings=embed[mx.array(PROMPT[4:13])])
    positions = MropePositions(triples=[(i, i, i) for i in range(len(PROMPT))])
    vision = VisionMap.validated([injection], positions, len(PROMPT), arch.hidden_size)
    np.testing.assert_allclose(_run(tmp_path, vision), plain, atol=1e-5)


def _hf_mrope(
    x: np.ndarray, positions: np.ndarray, dims: int, base: float, section: tuple[int, ...]
) -> np.ndarray:
    """HF ``Qwen3_5TextRotaryEmbedding`` + ``apply_rotary_pos_emb`` in numpy."""
    inv_freq = 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    freqs = positions[..., None].astype(np.float64) * inv_freq  # (3, L, dims/2)
    thw = freqs[0].copy()
    for axis, offset in ((1, 1), (2, 2)):
        thw[..., offset : section[axis] * 3 : 3] = freqs[axis, ..., offset : section[axis] * 3 : 3]
    emb = np.concatenate([thw, thw], axis=-1)  # (L, dims)
    rot, rest = x[..., :dims], x[..., dims:]
    half = np.concatenate([-rot[..., dims // 2 :], rot[..., : dims // 2]], axis=-1)
    return np.concatenate([rot * np.cos(emb) + half * np.sin(emb), rest], axis=-1)


@pytest.mark.parametrize("head_dim", [256, 32])
def test_distinct_triples_follow_hf(head_dim: int) -> None:
    section = (11, 11, 10) if head_dim == 256 else (2, 1, 1)
    arch = QwenGdnConfig(
        family="qwen_gdn",
        vocab_size=16,
        hidden_size=64,
        num_hidden_layers=4,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": section},
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 2, 9, head_dim)).astype(np.float32)
    positions = np.stack([np.arange(9) + 3, rng.integers(0, 6, 9), rng.integers(0, 6, 9)])
    got = QwenRope(arch)(mx.array(x), 0, mx.array(positions, dtype=mx.int32))
    expected = _hf_mrope(x, positions, arch.rotary_dims, 1e7, section)
    np.testing.assert_allclose(np.array(got), expected, atol=2e-5)
