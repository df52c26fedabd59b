"""The conformance kit catches broken families and says what leaked.

Each mutant is a throwaway plugin wrapping the real gemma4 family through
``FamilyRegistry.register`` (``mutant_families.py``), with one fault: a state component object shared
between sessions (only the KV is really swapped), a KV whose ``reset()``
forgets its position but keeps its rows, a KV whose snapshots hold the
buffers the forward writes in place, a KV whose rewind skips its last layer,
a forward whose RoPE is one position off on continued chunks, a batch whose
K/V merge crosses its rows in one layer, or a forward that keeps the tokens it
saw on the model object. The kit's checks are run programmatically on the
mutant and must fail naming the component and the layer (or, for state on the
model, the model's attribute); the unmutated wrapper passes the same checks,
so the failures are the fault's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mutant_families import BatchingGemma4, CacheOnTheModel, MutantGemma4

from turbospark.cli import main
from turbospark.conformance import FamilyConformance, FamilyKit
from turbospark.contract.hookspecs import LogitsWanted, hookimpl
from turbospark.contract.protocols import LayerHook
from turbospark.contract.vision import VisionMap
from turbospark.loading.install import build_synthetic_install
from turbospark.loading.plugins import FamilyRegistry, default_registry
from turbospark.state.components import Snapshot, State
from turbospark.state.kv import BatchKV, BatchLayerKV, KVComponent


class LeakyResetKV(KVComponent):
    """Forgets its position on ``reset()`` but keeps every layer's rows."""

    def reset(self) -> None:
        self._position = 0


def leak_across_reset(state: State, model: object) -> State:
    return {**state, "kv": LeakyResetKV(len(state["kv"].layers))}


class AliasingSnapshotKV(KVComponent):
    """Snapshots hold the live buffers themselves, which the forward writes in place."""

    def snapshot(self) -> Snapshot:
        snap = {"position": mx.array(self.position)}
        for i, layer in enumerate(self.layers):
            if layer.keys is not None:
                snap.update({f"{i}.keys": layer.keys, f"{i}.values": layer.values})
                snap[f"{i}.fill"] = mx.array(layer.fill)
        return snap

    def restore(self, snapshot: Snapshot) -> None:
        for i, layer in enumerate(self.layers):
            layer.keys, layer.values = snapshot.get(f"{i}.keys"), snapshot.get(f"{i}.values")
            layer.fill = int(snapshot[f"{i}.fill"].item()) if layer.keys is not None else 0
        self._position = int(snapshot["position"].item())


def alias_snapshots(state: State, model: object) -> State:
    return {**state, "kv": AliasingSnapshotKV(len(state["kv"].layers))}


class RewindSkipsLastLayerKV(KVComponent):
    """Rewinds every layer but the last one: its rows past the cut stay."""

    def rewind(self, n: int) -> None:
        for layer in self.layers[:-1]:
            layer.rewind(n)
        self._position -= n


def skip_a_layer_on_rewind(state: State, model: object) -> State:
    return {**state, "kv": RewindSkipsLastLayerKV(len(state["kv"].layers))}


class RopeOffByOne(MutantGemma4):
    """Rotates a continued chunk (``start > 0``) as if it began one position later."""

    @hookimpl
    def turbospark_forward(
        self,
        model: nn.Module,
        tokens: mx.array,
        start: int,
        state: State,
        vision: VisionMap | None,
        logits: LogitsWanted,
        steer: LayerHook | None,
    ) -> mx.array | None:
        return self.base.turbospark_forward(
            model=model,
            tokens=tokens,
            start=start + 1 if start else start,
            state=state,
            vision=vision,
            logits=logits,
            steer=steer,
        )


class SteersOneLayerEarly(MutantGemma4):
    """Hands each layer's output the steering meant for the next layer (a hook
    placed before the layer instead of after it)."""

    @hookimpl
    def turbospark_forward(
        self,
        model: nn.Module,
        tokens: mx.array,
        start: int,
        state: State,
        vision: VisionMap | None,
        logits: LogitsWanted,
        steer: LayerHook | None,
    ) -> mx.array | None:
        early = None if steer is None else (lambda i, h: steer(i + 1, h))
        return self.base.turbospark_forward(
            model=model,
            tokens=tokens,
            start=start,
            state=state,
            vision=vision,
            logits=logits,
            steer=early,
        )


class ShareWindow:
    """Hands every session the same ``window`` object: only ``kv`` is really swapped."""

    def __init__(self) -> None:
        self.shared: Any = None

    def __call__(self, state: State, model: object) -> State:
        self.shared = self.shared or state["window"]
        return {**state, "window": self.shared}


CHECKS = FamilyConformance()

# (check, arguments, pattern its failure message must match)
SHARED_WINDOW_FAILURES = [
    (CHECKS.test_state_matches_declaration, (), r"component 'window' .* same object .*'window'"),
    (
        CHECKS.test_parked_sessions_resume_exactly,
        (),
        r"Runner.open\(session_slots=3\): component 'window' of parked slot 0 is the same object",
    ),
    pytest.param(
        CHECKS.test_interleaved_conversations_never_cross_talk,
        (),
        r"(?s)Schedule\(slots=\d.*component 'window' .* same object",
        marks=pytest.mark.slow,  # hypothesis searches schedules until one shows the sharing
        id="interleaved",
    ),
]
LEAKY_RESET_FAILURES = [
    (
        CHECKS.test_nbytes_honest,
        ("kv",),
        r"component 'kv' after reset\(\) .* reset\(\) leaks state",
    ),
    (
        CHECKS.test_reset_forgets_the_conversation,
        (),
        r"what leaked across reset\(\): component 'kv' entry '\d+\.keys' has shape",
    ),
    (
        CHECKS.test_pool_of_one_is_a_no_op,
        (),
        r"session_slots=0, turn 3: C .* logits differ(.|\n)*component 'kv' entry",
    ),
]


ALIASING_SNAPSHOT_FAILURES = [
    (
        CHECKS.test_snapshot_round_trip,
        ("kv",),
        r"snapshot of 'kv' changed when the state was written \('0\.keys'\): it aliases",
    ),
]


@pytest.mark.parametrize("mutant_kit", [("gemma4_shared_window", ShareWindow())], indirect=True)
@pytest.mark.parametrize("check, args, pattern", SHARED_WINDOW_FAILURES)
def test_shared_component_is_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    with pytest.raises(AssertionError) as failure:
        check(mutant_kit, *args)
    assert re.search(pattern, str(failure.value)), str(failure.value)


@pytest.mark.parametrize("mutant_kit", [("gemma4_leaky_reset", leak_across_reset)], indirect=True)
@pytest.mark.parametrize("check, args, pattern", LEAKY_RESET_FAILURES)
def test_leak_across_reset_is_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    with pytest.raises(AssertionError) as failure:
        check(mutant_kit, *args)
    assert re.search(pattern, str(failure.value)), str(failure.value)


@pytest.mark.parametrize("mutant_kit", [("gemma4_aliasing", alias_snapshots)], indirect=True)
@pytest.mark.parametrize("check, args, pattern", ALIASING_SNAPSHOT_FAILURES)
def test_aliasing_snapshot_is_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    with pytest.raises(AssertionError) as failure:
        check(mutant_kit, *args)
    assert re.search(pattern, str(failure.value)), str(failure.value)


SKIPPED_LAYER_FAILURES = [
    (
        CHECKS.test_rewind_then_refeed,
        ("kv",),
        r"after rewinding 'kv' by 6 of 16 tokens .* what differs: component 'kv' entry '0\.keys' "
        r"has shape \(1, \d+, 24, \d+\), a fresh run \(1, \d+, 18, \d+\)",
    ),
    (
        CHECKS.test_a_rejected_draft_leaves_no_trace,
        (),
        r"after verifying 5 tokens and keeping 1, the next step's logits differ .* "
        r"a rejected token left a trace in the state; the session after it, against a fresh run "
        r"of its 14 tokens: component 'kv' entry '0\.keys' has shape \(1, \d+, 18, \d+\), a "
        r"fresh run \(1, \d+, 14, \d+\)",
    ),
]
ROPE_FAILURES = [
    (
        CHECKS.test_chunked_prefill_equals_sequential,
        (),
        r"prefill token by token, 0 decode step\(s\) in: logits differ .* component 'kv' entry "
        r"'0\.keys' differs from a fresh run by up to \S+ first at index \(0, \d+, 1, \d+\)",
    ),
]


@pytest.mark.parametrize(
    "mutant_kit", [("gemma4_skips_layer", skip_a_layer_on_rewind)], indirect=True
)
@pytest.mark.parametrize("check, args, pattern", SKIPPED_LAYER_FAILURES)
def test_rewind_skipping_a_layer_is_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    with pytest.raises(AssertionError) as failure:
        check(mutant_kit, *args)
    assert re.search(pattern, str(failure.value)), str(failure.value)


@pytest.mark.parametrize("mutant_kit", [("gemma4_rope", None, RopeOffByOne)], indirect=True)
@pytest.mark.parametrize("check, args, pattern", ROPE_FAILURES)
def test_rope_off_by_one_on_continued_chunks_is_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    with pytest.raises(AssertionError) as failure:
        check(mutant_kit, *args)
    assert re.search(pattern, str(failure.value)), str(failure.value)


class CrossedWrites(BatchLayerKV):
    """Writes each batched step's new keys and values into the rows in reverse
    order: every row's newest column holds another session's."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, int]:
        rows = mx.arange(keys.shape[0] - 1, -1, -1)
        return super().update_and_fetch(keys[rows], values[rows])


class CrossesRowsInItsLastLayer(KVComponent):
    """A K/V whose batches write crossed rows in their last layer only."""

    @classmethod
    def merge(cls, parts: list[KVComponent]) -> BatchKV:
        batch = KVComponent.merge(parts)
        last = batch.layers[-1]
        batch.layers[-1] = CrossedWrites(
            last.window, last.headroom, last.keys, last.values, last.left, last.fill
        )
        return batch


def cross_rows_in_a_layer(state: State, model: object) -> State:
    return {**state, "kv": CrossesRowsInItsLastLayer(len(state["kv"].layers))}


CROSSED_ROWS_FAILURES = [
    (
        CHECKS.test_batched_rows_equal_each_row_alone,
        (),
        r"batched step 0, row 0 \(a 3-token session among 2\): logits \S+ off the same session "
        r"alone; row 0 copied out of the batch: component 'kv' entry '0\.keys' differs from the "
        r"same session alone by up to \S+ first at index \(0, 0, 3, 0\)",
    ),
    pytest.param(
        CHECKS.test_engine_schedules_never_cross_talk,
        (),
        r"Plan\(batch \d: .*\): request \d decoded beside others gave \[.*\], alone \[.*\] "
        r"\(peak batch \d\); its session, holding \d+ tokens, against a fresh run of them: "
        r"component 'kv' entry '0\.(keys|values)' (has shape|differs)",
        marks=pytest.mark.slow,  # hypothesis shrinks the plan to the smallest that fails
        id="engine",
    ),
]


@pytest.mark.parametrize(
    "mutant_kit", [("gemma4_crossed_rows", cross_rows_in_a_layer, BatchingGemma4)], indirect=True
)
@pytest.mark.parametrize("check, args, pattern", CROSSED_ROWS_FAILURES)
def test_rows_crossed_in_one_layer_are_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    with pytest.raises(AssertionError) as failure:
        check(mutant_kit, *args)
    assert re.search(pattern, str(failure.value)), str(failure.value)


@pytest.mark.parametrize("mutant_kit", [("gemma4_batching", None, BatchingGemma4)], indirect=True)
@pytest.mark.parametrize("check, args, pattern", CROSSED_ROWS_FAILURES)
def test_the_batching_wrapper_alone_passes(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    check(mutant_kit, *args)


# A new model of the cache mutant, warmed on three forwards, holds a list of 3.
MODEL_STATE_FAILURES = [
    (
        CHECKS.test_model_keeps_no_conversation,
        (),
        r"a new state on a model that has served 19 tokens of another conversation gives logits "
        r"up to \S+ off a new state on a freshly loaded model: the model object keeps "
        r"conversation state.*; the model holds what a new one does not: model\.seen_tokens is "
        r"list of 5 \(a new model: list of 3\)$",
    ),
    (
        CHECKS.test_reset_forgets_the_conversation,
        (),
        r"after reset\(\) a new conversation's logits differ from a fresh state's by up to \S+; "
        r"what leaked across reset\(\): no component differs from a fresh run, but the model "
        r"object holds state .*: model\.seen_tokens is list of \d+ \(a new model: list of 3\)$",
    ),
    (
        CHECKS.test_drafted_greedy_output_equals_off,
        (),
        r"with a 100% right drafter, greedy output differs from decoding without drafts at token "
        r"\d+: \d+ instead of \d+; the session after it, against a fresh run of its \d+ tokens: no "
        r"component differs from a fresh run, but the model object holds state .*: "
        r"model\.seen_tokens is list of \d+ \(a new model: list of 3\)$",
    ),
]


@pytest.mark.parametrize(
    "mutant_kit", [("gemma4_cache_on_model", None, CacheOnTheModel)], indirect=True
)
@pytest.mark.parametrize("check, args, pattern", MODEL_STATE_FAILURES)
def test_state_kept_on_the_model_is_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    with pytest.raises(AssertionError) as failure:
        check(mutant_kit, *args)
    assert re.search(pattern, str(failure.value)), str(failure.value)


def test_each_reference_runs_on_a_model_of_its_own(tmp_path: Path) -> None:
    """A reference is a fresh run however many came before it: the cache
    mutant's references never see each other's tokens."""
    registry = FamilyRegistry()
    plugin = CacheOnTheModel("gemma4_cache_refs", None, default_registry().get("gemma4").plugin)
    registry.register(plugin, name="gemma4_cache_refs")
    try:
        build_synthetic_install("gemma4_cache_refs", tmp_path, registry=registry, num_layers=2)
        kit = FamilyKit.create("gemma4_cache_refs", tmp_path, registry)
        prompt = kit.tokens(1, 6)
        first = kit.fresh_logits(prompt)
        for seed in range(2, 5):
            kit.fresh_logits(kit.tokens(seed, 9))
        kit._references.clear()
        assert mx.array_equal(kit.fresh_logits(prompt), first)
        assert kit.fresh_run(prompt).model is not kit.fresh_run(prompt).model
    finally:
        registry.unregister("gemma4_cache_refs")


STEER_EARLY_FAILURES = [
    (
        CHECKS.test_one_layer_leaves_the_layers_below_identical,
        (),
        r"called steer\(i, h\) for layers \[1, 2, 1, 2\]; expected every layer 0\.\.1 once",
    ),
]


@pytest.mark.parametrize(
    "mutant_kit", [("gemma4_steer_early", None, SteersOneLayerEarly)], indirect=True
)
@pytest.mark.parametrize("check, args, pattern", STEER_EARLY_FAILURES)
def test_steering_one_layer_early_is_caught(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    with pytest.raises(AssertionError) as failure:
        check(mutant_kit, *args)
    assert re.search(pattern, str(failure.value)), str(failure.value)


@pytest.mark.parametrize("mutant_kit", [("gemma4_unmutated", None)], indirect=True)
@pytest.mark.parametrize(
    "check, args, pattern",
    SHARED_WINDOW_FAILURES
    + LEAKY_RESET_FAILURES
    + ALIASING_SNAPSHOT_FAILURES
    + SKIPPED_LAYER_FAILURES
    + ROPE_FAILURES
    + STEER_EARLY_FAILURES
    + MODEL_STATE_FAILURES,
)
def test_the_wrapper_alone_passes(
    mutant_kit: FamilyKit, check: Callable[..., None], args: tuple[str, ...], pattern: str
) -> None:
    check(mutant_kit, *args)


# A subprocess running the whole kit: the full suite, not the inner loop.
@pytest.mark.slow
def test_conformance_command_fails_a_mutant_naming_the_leak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``turbospark conformance`` on an installed mutant (a throwaway
    distribution whose entry point is the leaky-reset wrapper) exits 1 and
    reports each failed check with what leaked."""
    info = tmp_path / "turbospark_leaky-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: turbospark-leaky\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[turbospark]\ngemma4_leaky_cli = turbospark_leaky_cli:plugin\n"
    )
    (tmp_path / "turbospark_leaky_cli.py").write_text(
        "import importlib\n\n"
        "from mutant_families import MutantGemma4\n"
        "from turbospark_gemma4 import plugin as gemma4\n\n"
        f"mutants = importlib.import_module({__name__!r})  # this test module, already imported\n"
        "plugin = MutantGemma4('gemma4_leaky_cli', mutants.leak_across_reset, gemma4)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TURBOSPARK_PLUGINS", f"gemma4_leaky_cli,{tmp_path.name}")
    assert main(["conformance", "gemma4_leaky_cli", "--examples", "3"]) == 1
    report = capsys.readouterr().out
    assert "conformance of family 'gemma4_leaky_cli' (turbospark-leaky==0.1.0)" in report
    assert "  FAIL  nbytes_honest[kv]\n" in report
    assert "reset() leaks state" in report
    assert "  PASS  nbytes_honest[window]\n" in report
    assert report.rstrip().splitlines()[-1].startswith("FAILED: ")
