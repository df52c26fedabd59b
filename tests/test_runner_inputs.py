"""Bad input is refused with a clear error, and no session — live or parked — changes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from helpers import open_runner, text_positions
from turbospark import (
    ContextOverflow,
    ExpertCacheSlots,
    InstallError,
    InvalidInput,
    Runner,
    TurbosparkError,
    VisionMapError,
)
from turbospark.contract.hookspecs import hookimpl
from turbospark.errors import FamilyNotFound, RewindError
from turbospark.loading.install import MANIFEST, sha256_file
from turbospark.loading.plugins import FamilyRegistry
from turbospark.sessions.reuse import ReuseReason
from turbospark.state.components import LayeredComponent

A = [100, 101, 5, 9, 2, 7, 1, 3, 8, 4, 6, 0, 11]
A_MORE = [99, 98, 97]
B = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


def uninterrupted(path: Path, chunks: list[list[int]], registry=None) -> mx.array:
    runner = Runner.open(path, registry=registry)
    start, logits = 0, None
    for chunk in chunks:
        logits = runner.prefill_chunk(chunk, start)
        start += len(chunk)
    return logits


@pytest.fixture
def parked_and_live(gemma4_install):
    """A pooled runner with conversation A parked and B live."""
    runner = open_runner(gemma4_install, 2)
    runner.prefill_chunk(A, 0)
    assert runner.try_reuse_prefix(B) == 0
    runner.reset()
    runner.prefill_chunk(B, 0)
    return runner


def assert_sessions_untouched(runner: Runner, install: Path) -> None:
    """B continues exactly, then A resumes exactly, as if nothing had happened."""
    b_next = runner.prefill_chunk([20, 21], len(B))
    assert mx.allclose(b_next, uninterrupted(install, [B, [20, 21]]), atol=1e-5)
    prompt = A + A_MORE
    kept = runner.try_reuse_prefix(prompt)
    assert kept == len(A), runner.last_reuse
    resumed = runner.prefill_chunk(prompt[kept:], kept)
    assert mx.allclose(resumed, uninterrupted(install, [A, A_MORE]), atol=1e-5)


@pytest.mark.parametrize(
    ("call", "error", "needle"),
    [
        (lambda r: r.produce(128, len(B)), InvalidInput, "outside this model's vocabulary"),
        (lambda r: r.produce(-1, len(B)), InvalidInput, "outside this model's vocabulary"),
        (lambda r: r.prefill_chunk([1, 2, 500], len(B)), InvalidInput, "500"),
        (lambda r: r.produce(3, len(B) + 2), InvalidInput, "position gap"),
        (lambda r: r.prefill_chunk([], len(B)), InvalidInput, "no tokens"),
        (lambda r: r.prefill_chunk([1] * 5000, len(B)), ContextOverflow, "context length 4096"),
        (
            lambda r: r.set_prompt_vision([], text_positions(3), 5),
            VisionMapError,
            "3 rope triples for a 5-token prompt",
        ),
    ],
    ids=["token-too-big", "token-negative", "token-in-chunk", "gap", "empty", "overflow", "vision"],
)
def test_bad_input_is_refused_and_no_session_changes(
    parked_and_live, gemma4_install, call, error, needle
):
    with pytest.raises(error, match=needle):
        call(parked_and_live)
    assert parked_and_live.position == len(B)
    assert_sessions_untouched(parked_and_live, gemma4_install)


def test_a_rewind_the_state_cannot_make_is_refused_and_changes_nothing(qwen_gdn_install):
    runner = Runner.open(qwen_gdn_install)
    runner.prefill_chunk(A, 0)
    with pytest.raises(RewindError, match="'gdn' at most 0"):
        runner.produce(3, 5)
    assert runner.position == len(A)
    assert mx.allclose(
        runner.prefill_chunk(A_MORE, len(A)),
        uninterrupted(qwen_gdn_install, [A, A_MORE]),
        atol=1e-5,
    )


def test_expert_cache_slots_are_validated(gemma4_install):
    with pytest.raises(InvalidInput, match="at least one expert slot"):
        ExpertCacheSlots.fixed(0)
    with pytest.raises(InvalidInput, match="top_k_experts=4"):
        Runner.open(gemma4_install, expert_cache=ExpertCacheSlots.fixed(2))


def copy_install(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "install"
    shutil.copytree(src, dst)
    return dst


def rewrite_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def rehash(path: Path, name: str) -> None:
    def edit(manifest):
        manifest["files"][name] = {
            "size": (path / name).stat().st_size,
            "sha256": sha256_file(path / name),
        }

    rewrite_manifest(path, edit)


def test_malformed_manifest_json_names_the_file(gemma4_install, tmp_path):
    path = copy_install(gemma4_install, tmp_path)
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(InstallError, match=r"manifest\.json is not valid JSON"):
        Runner.open(path)


def test_manifest_missing_field_names_the_field(gemma4_install, tmp_path):
    path = copy_install(gemma4_install, tmp_path)
    rewrite_manifest(path, lambda m: m.pop("model_id"))
    with pytest.raises(InstallError, match="model_id: Field required"):
        Runner.open(path)


def test_manifest_arch_field_of_the_wrong_type_is_named(gemma4_install, tmp_path):
    path = copy_install(gemma4_install, tmp_path)
    rewrite_manifest(path, lambda m: m["arch"].update(hidden_size="wide"))
    with pytest.raises(InstallError, match="hidden_size"):
        Runner.open(path)


def test_unknown_family_lists_the_installed_ones(gemma4_install, tmp_path):
    path = copy_install(gemma4_install, tmp_path)
    rewrite_manifest(path, lambda m: m.update(family="llama9"))
    with pytest.raises(FamilyNotFound, match=r"'llama9'.*installed: .*gemma4"):
        Runner.open(path)


def test_sha256_mismatch_is_refused(gemma4_install, tmp_path):
    path = copy_install(gemma4_install, tmp_path)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(InstallError, match="sha256 mismatch"):
        Runner.open(path)


def test_missing_file_is_refused(gemma4_install, tmp_path):
    path = copy_install(gemma4_install, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(InstallError, match=r"config\.json is listed in manifest\.json but missing"):
        Runner.open(path)


def _rewrite_weights(path: Path, edit) -> None:
    weights = mx.load(str(path / "model.safetensors"))
    edit(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    rehash(path, "model.safetensors")


def test_missing_tensor_is_named(gemma4_install, tmp_path):
    path = copy_install(gemma4_install, tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite_weights(path, lambda w: w.pop(name))
    with pytest.raises(InstallError, match=f"missing tensor.*{name}"):
        Runner.open(path)


def test_mis_shaped_tensor_is_named(gemma4_install, tmp_path):
    path = copy_install(gemma4_install, tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite_weights(path, lambda w: w.update({name: w[name][:-1]}))
    with pytest.raises(InstallError, match=f"tensor {name} has shape"):
        Runner.open(path)


def test_an_arch_that_does_not_match_the_install_is_refused(gemma4_install, qwen_gdn_install):
    from turbospark import peek_manifest_arch

    with pytest.raises(InstallError, match="does not match"):
        Runner.open(gemma4_install, arch=peek_manifest_arch(qwen_gdn_install))


def test_every_refusal_is_a_turbospark_error():
    for cls in (
        InvalidInput,
        ContextOverflow,
        VisionMapError,
        InstallError,
        RewindError,
        FamilyNotFound,
    ):
        assert issubclass(cls, TurbosparkError)


def test_numpy_integer_tokens_are_accepted_and_floats_refused(gemma4_install):
    import numpy as np

    runner = Runner.open(gemma4_install)
    logits = runner.prefill_chunk(list(np.array(A, dtype=np.int64)), 0)
    assert mx.allclose(logits, uninterrupted(gemma4_install, [A]), atol=1e-6)
    with pytest.raises(InvalidInput, match="outside this model's vocabulary"):
        runner.produce(3.0, len(A))
    with pytest.raises(InvalidInput, match="outside this model's vocabulary"):
        runner.produce(True, len(A))


class ExplodingForward:
    """A throwaway family: gemma4, except that token 127 makes the forward fail
    after every layer has written its K/V (the worst place to fail)."""

    def __init__(self, family):
        self.family = family

    @hookimpl
    def turbospark_family(self):
        return self.family.spec.model_copy(update={"name": "exploding"})

    @hookimpl
    def turbospark_pool_capability(self, arch):
        return self.family.manager().hook.turbospark_pool_capability(arch=arch)

    @hookimpl
    def turbospark_load_model(self, arch, weights, dtype, experts):
        return self.family.manager().hook.turbospark_load_model(
            arch=arch, weights=weights, dtype=dtype, experts=experts
        )

    @hookimpl
    def turbospark_new_state(self, arch, model, context_length):
        hook = self.family.manager().hook
        return hook.turbospark_new_state(arch=arch, model=model, context_length=context_length)

    @hookimpl
    def turbospark_forward(self, model, tokens, start, state, vision, logits, steer):
        out = self.family.manager().hook.turbospark_forward(
            model=model,
            tokens=tokens,
            start=start,
            state=state,
            vision=vision,
            logits=logits,
            steer=steer,
        )
        if 127 in tokens.tolist():
            raise RuntimeError("kernel failure")
        return out


@pytest.fixture
def exploding_install(gemma4_install, tmp_path):
    path = copy_install(gemma4_install, tmp_path)
    rewrite_manifest(path, lambda m: m.update(family="exploding"))
    registry = FamilyRegistry.discover()
    registry.register(ExplodingForward(registry.get("gemma4")), name="exploding")
    return path, registry


def test_a_failed_forward_taints_the_record_and_restores_the_position(exploding_install):
    path, registry = exploding_install
    runner = Runner.open(path, session_slots=2, registry=registry)
    runner.set_prefix_reuse(True)
    runner.prefill_chunk(B, 0)  # parked below
    runner.reset()
    runner.prefill_chunk(A, 0)
    with pytest.raises(RuntimeError, match="kernel failure"):
        runner.prefill_chunk([5, 127, 6], len(A))
    assert runner.position == len(A), "state is put back where the failed call started"
    # The live record is tainted: its ids can no longer vouch for the state.
    assert runner.try_reuse_prefix([*A, 1]) == 0
    assert runner.last_reuse.reason == ReuseReason.TAINTED
    # The parked conversation is untouched and still found by content.
    kept = runner.try_reuse_prefix([*B, 20, 21])
    assert kept == len(B)
    logits = runner.prefill_chunk([20, 21], len(B))
    assert mx.allclose(logits, uninterrupted(path, [B, [20, 21]], registry), atol=1e-5)


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_a_forward_failing_before_its_state_advances_leaves_no_trace(family, request):
    """Layers that ran wrote past the component's position before the forward
    failed (here: every layer wrote, then ``advance`` raised); a caller that keeps
    feeding the same session must get the uninterrupted logits."""
    path = request.getfixturevalue(f"{family}_install")
    runner = Runner.open(path)
    runner.prefill_chunk(A, 0)
    layered = [c for c in runner.session_states()[0].values() if isinstance(c, LayeredComponent)]
    assert layered

    def advance(n: int) -> None:
        raise RuntimeError("failed between the layers and advance")

    for component in layered:
        component.advance = advance
    with pytest.raises(RuntimeError, match="between the layers"):
        mx.eval(runner.prefill_chunk([5, 6, 7], len(A)))
    for component in layered:
        del component.advance
    assert runner.position == len(A)
    logits = runner.prefill_chunk([20, 21], len(A))
    assert mx.allclose(logits, uninterrupted(path, [A, [20, 21]]), atol=1e-5)
