"""The public API (``turbospark/__init__.py``, README's "Python API"), called
exactly as written there: outside code relies on it."""

from __future__ import annotations

import mlx.core as mx

from turbospark import (
    DraftPolicies,
    ExpertCacheSlots,
    MropePositions,
    ReuseReport,
    Runner,
    SessionPoolUnsupported,
    SteeringPolicy,
    TurbosparkError,
    build_synthetic_install,
    peek_manifest_arch,
)


def test_the_design_documents_api_end_to_end(tmp_path):
    arch = build_synthetic_install("gemma4", tmp_path / "g", vocab_size=128, num_layers=2,
                                   num_experts=16, top_k_experts=4, sliding_window=8,
                                   model_id="tiny", seed=0)  # fmt: skip
    build_synthetic_install(
        "qwen_gdn", tmp_path / "q", vocab_size=128, num_layers=4, model_id="tiny"
    )
    build_synthetic_install("qwen4_exp", tmp_path / "x", vocab_size=128, model_id="tiny")
    assert peek_manifest_arch(tmp_path / "g") == arch
    assert issubclass(SessionPoolUnsupported, TurbosparkError)

    runner = Runner.open(tmp_path / "g", arch=None, context_length=4096,
                         expert_cache=ExpertCacheSlots.fixed(16), draft=DraftPolicies.off(),
                         steering=SteeringPolicy.off(), session_slots=2)  # fmt: skip
    runner.set_prefix_reuse(True)
    runner.reset()
    logits = runner.produce(5, 0)
    assert logits.shape == (128,) and logits.dtype == mx.float32
    runner.produce_prefill(6, 1)
    logits = runner.prefill_chunk([7, 8, 9], 2)
    assert logits.shape == (128,)
    kept = runner.try_reuse_prefix([5, 6, 7, 8, 9, 10])
    assert kept == 5 and isinstance(runner.last_reuse, ReuseReport)
    assert (runner.last_reuse.kept, runner.last_reuse.swapped) == (5, False)
    assert runner.session_slot_evicted() is False
    runner.set_prompt_vision(
        [], MropePositions(triples=[(i, i, i) for i in range(6)], rope_delta=0, spans=[]), 6
    )
    runner.clear_prompt_vision()
    assert runner.session_pool_size == 2
