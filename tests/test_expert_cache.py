"""Routed experts streamed into a bounded cache (``ExpertCacheSlots``): the
same logits as every expert resident, the memory it saves, the eviction
order, batched rows, and every refusal before a weight is read."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mutant_families import MutantGemma4
from prometheus_client.parser import text_string_to_metric_families
from serving import client, service, serving
from test_engine import Collector

from turbospark import ExpertCacheSlots, Runner, build_synthetic_install
from turbospark.cli import main
from turbospark.conformance import FamilyConformance, FamilyKit
from turbospark.contract.hookspecs import hookimpl
from turbospark.errors import InstallError, InvalidInput
from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.loading.install import load_weights, read_manifest, write_install
from turbospark.loading.plugins import FamilyRegistry, default_registry
from turbospark.sessions.session import Session
from turbospark.text import load_text

TOP_K, EXPERTS = 2, 8
PROMPT = [3, 17, 42, 9, 88, 5, 61, 23, 100, 7, 12, 77, 31, 54, 2, 90]


@pytest.fixture(scope="module")
def moe_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "install"
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, num_experts=EXPERTS,
        top_k_experts=TOP_K, moe_intermediate_size=48, seed=3,
    )  # fmt: skip
    return path


def run(install: Path, policy: ExpertCacheSlots, steps: int = 4) -> list[np.ndarray]:
    """Prompt logits, then greedy decode logits, through the runner."""
    runner = Runner.open(install, expert_cache=policy)
    logits = runner.prefill_chunk(PROMPT, 0)
    out = [np.array(logits)]
    for i in range(steps):
        logits = runner.produce(int(mx.argmax(logits)), len(PROMPT) + i)
        out.append(np.array(logits))
    return out


@pytest.mark.parametrize("slots", [TOP_K, 2 * TOP_K, 4 * TOP_K - 1])
def test_logits_equal_all_resident(moe_install, slots):
    reference = run(moe_install, ExpertCacheSlots.all())
    for step, (got, want) in enumerate(zip(run(moe_install, ExpertCacheSlots.fixed(slots)), reference, strict=True)):  # fmt: skip
        assert np.array_equal(got, want), f"step {step} differs under fixed({slots})"


def test_the_kit_check_passes_on_a_moe_install(moe_install):
    kit = FamilyKit.create("gemma4", moe_install)
    FamilyConformance().test_expert_cache_slots_give_identical_logits(kit)


def test_more_slots_than_experts_or_all_loads_everything(moe_install):
    for policy in (ExpertCacheSlots.fixed(EXPERTS), ExpertCacheSlots.all()):
        stats = Runner.open(moe_install, expert_cache=policy).expert_cache_stats()
        assert stats.slots_per_layer == EXPERTS and stats.misses == 0


def test_stats_count_hits_misses_and_bytes(moe_install):
    runner = Runner.open(moe_install, expert_cache=ExpertCacheSlots.fixed(4))
    full = Runner.open(moe_install).expert_cache_stats().resident_bytes
    fresh = runner.expert_cache_stats()
    assert (fresh.hits, fresh.misses, fresh.bytes_read) == (0, 0, 0)
    assert fresh.resident_bytes * EXPERTS == full * 4
    runner.prefill_chunk(PROMPT, 0)
    stats = runner.expert_cache_stats()
    one_expert = full // (EXPERTS * stats.layers)
    assert stats.misses > 0 and stats.bytes_read == stats.misses * one_expert


def test_resident_memory_is_a_fraction_of_all(moe_install, tmp_path):
    """MLX's active memory with 2 of 16 experts resident, against all of them."""
    path = tmp_path / "big"
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, num_experts=16, top_k_experts=2,
        moe_intermediate_size=256, hidden_size=128, intermediate_size=64,
    )  # fmt: skip

    def active(policy: ExpertCacheSlots) -> tuple[int, int]:
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        runner = Runner.open(path, expert_cache=policy)
        used = mx.get_active_memory() - before
        experts = runner.expert_cache_stats().resident_bytes
        del runner
        return used, experts

    all_used, all_experts = active(ExpertCacheSlots.all())
    few_used, few_experts = active(ExpertCacheSlots.fixed(2))
    assert few_experts * 8 == all_experts
    saved = all_used - few_used
    assert abs(saved - (all_experts - few_experts)) < 0.05 * all_experts


def test_eviction_is_lfu_then_lru_and_spares_the_current_step(moe_install):
    runner = Runner.open(moe_install, expert_cache=ExpertCacheSlots.fixed(3))
    cache = next(iter(runner._experts.caches.values()))

    def step(*rows: list[int]) -> None:
        for _ in cache.groups(mx.array(list(rows))):
            pass

    step([0, 1], [0, 1])  # 0 and 1 used twice
    step([2, 0])  # 2 once, 0 three times: slots full
    step([3, 1])  # evicts 2 (fewest uses), not 1 (pinned)
    assert set(cache.resident) == {0, 1, 3}
    step([4, 0])  # 1 (2 uses) vs 3 (1 use): 3 goes
    assert set(cache.resident) == {0, 1, 4}
    step([4, 4])  # 4 now has 3 uses, as 1 has
    step([5, 0])  # 1 and 4 tie on uses: the least recently used (1) goes
    assert set(cache.resident) == {0, 4, 5}


@settings(max_examples=20, deadline=None)
@given(st.lists(st.lists(st.integers(0, EXPERTS - 1), min_size=TOP_K, max_size=TOP_K), min_size=1, max_size=12))  # fmt: skip
def test_every_slot_holds_its_experts_weights(moe_install, routes):
    """Whatever the routing, a resident expert's slot equals its tensor in the install."""
    runner = Runner.open(moe_install, expert_cache=ExpertCacheSlots.fixed(TOP_K + 1))
    weights = load_weights(moe_install, read_manifest(moe_install))
    path, cache = next(iter(runner._experts.caches.items()))
    fused = np.array(weights[path + ".gate_up_proj"])
    inner = fused.shape[1] // 2
    for row in routes:
        for group in cache.groups(mx.array([row])):
            for expert, slot in cache.resident.items():
                gate = np.array(group.tables["gate_proj"][slot])
                assert np.array_equal(gate, fused[expert, :inner])
        assert set(row) <= set(cache.resident) and len(cache.resident) <= TOP_K + 1


def test_batched_rows_equal_each_row_alone(moe_install):
    """Three rows decode together, routing to more experts than fit in top_k slots."""
    runner = Runner.open(moe_install, expert_cache=ExpertCacheSlots.fixed(TOP_K))
    histories = [PROMPT[:5], PROMPT[3:12], PROMPT[1:4]]
    alone = []
    sessions = []
    for history in histories:
        session = Session(runner._new_state())
        runner.feed(session, history, 0)
        sessions.append(session)
        copy = Session(runner._new_state())
        runner.feed(copy, history, 0)
        alone.append(copy)
    state = runner.merge_states(sessions)
    tokens = mx.array([[11], [22], [33]], dtype=mx.int32)
    batched = runner.forward_batch(tokens, [len(h) for h in histories], state)
    reference = Runner.open(moe_install)
    for i, history in enumerate(histories):
        want = reference.prefill_chunk([*history, int(tokens[i, 0])], 0)
        assert np.array_equal(np.array(batched[i]), np.array(want)), f"row {i}"


def test_refusals_come_before_any_weight_is_read(moe_install, qwen4_exp_install, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr("turbospark.generation.runner.load_weights", no_weights)
    with pytest.raises(InvalidInput, match=f"top_k_experts={TOP_K}"):
        Runner.open(moe_install, expert_cache=ExpertCacheSlots.fixed(TOP_K - 1))
    for policy in (ExpertCacheSlots.fixed(4), ExpertCacheSlots.auto()):
        with pytest.raises(InvalidInput, match=r"declares no MoE experts.*ExpertCacheSlots\.all"):
            Runner.open(qwen4_exp_install, expert_cache=policy)


def test_all_is_fine_on_a_family_without_moe(qwen4_exp_install):
    runner = Runner.open(qwen4_exp_install, expert_cache=ExpertCacheSlots.all())
    assert runner.expert_cache_stats() is None


def test_auto_picks_a_count_in_range(moe_install):
    stats = Runner.open(moe_install, expert_cache=ExpertCacheSlots.auto()).expert_cache_stats()
    assert TOP_K <= stats.slots_per_layer <= EXPERTS


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w.pop("model.layers.1.experts.down_proj"), r"down_proj(\.weight)? is missing"),
        (
            lambda w: w.update(
                {"model.layers.0.experts.gate_up_proj": mx.zeros((EXPERTS, 90, 64))}
            ),
            r"gate_up_proj has shape \(8, 90, 64\)",
        ),
    ],
)
def test_a_broken_expert_tensor_is_refused_by_name(moe_install, tmp_path, monkeypatch, change, message):  # fmt: skip
    arch = Runner.open(moe_install).arch
    weights = load_weights(moe_install, read_manifest(moe_install))
    change(weights)
    write_install(tmp_path / "broken", arch=arch, model_id="broken", weights=weights)
    monkeypatch.setattr(
        "turbospark.generation.runner.load_weights", lambda *a: pytest.fail("weights read")
    )
    for policy in (ExpertCacheSlots.fixed(TOP_K), ExpertCacheSlots.all()):
        with pytest.raises(InstallError, match=message):
            Runner.open(tmp_path / "broken", expert_cache=policy)


def test_a_file_that_disappears_fails_the_step_and_keeps_the_cache(moe_install, tmp_path):
    path = tmp_path / "install"
    shutil.copytree(moe_install, path)
    runner = Runner.open(path, expert_cache=ExpertCacheSlots.fixed(TOP_K))
    runner.prefill_chunk(PROMPT[:4], 0)
    before = {p: (c.resident, {k: np.array(v) for k, v in c.tables.items()})
              for p, c in runner._experts.caches.items()}  # fmt: skip
    stats = runner.expert_cache_stats()
    shutil.move(path / "model.safetensors", tmp_path / "away.safetensors")
    with pytest.raises(InstallError, match="install changed under the runner"):
        runner.prefill_chunk(PROMPT[4:], 4)
    for p, c in runner._experts.caches.items():
        resident, tables = before[p]
        if c.resident != resident:  # a layer before the failing one finished its step
            continue
        assert all(np.array_equal(np.array(c.tables[k]), v) for k, v in tables.items())
    assert runner.expert_cache_stats().misses >= stats.misses
    shutil.move(tmp_path / "away.safetensors", path / "model.safetensors")
    # The failed session is tainted (never resumed); a new conversation on the same cache:
    runner.reset()
    runner.prefill_chunk(PROMPT[:4], 0)
    got = runner.prefill_chunk(PROMPT[4:], 4)
    reference = Runner.open(moe_install)
    reference.prefill_chunk(PROMPT[:4], 0)
    want = reference.prefill_chunk(PROMPT[4:], 4)
    assert np.array_equal(np.array(got), np.array(want))


def test_cli_values_parse():
    assert ExpertCacheSlots.parse("8") == ExpertCacheSlots.fixed(8)
    assert ExpertCacheSlots.parse("auto").mode == "auto"
    assert ExpertCacheSlots.parse("ALL") == ExpertCacheSlots.all()
    for bad, message in (("0", "at least one expert slot"), ("many", "auto or all")):
        with pytest.raises(InvalidInput, match=message):
            ExpertCacheSlots.parse(bad)


def test_generate_streams_experts_from_the_cli(moe_install, capsys):
    args = ["generate", str(moe_install), "--prompt", "hello", "--max-tokens", "4", "--json"]
    assert main([*args, "--expert-cache-slots", "all"]) in (0, None)
    resident = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, "--expert-cache-slots", str(TOP_K)]) in (0, None)
    streamed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert streamed["tokens"] == resident["tokens"]


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_cli_refuses_too_few_slots_in_one_line(moe_install, capsys, command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, str(moe_install), *extra, "--expert-cache-slots", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"top_k_experts={TOP_K}" in err[0]


def test_a_bad_slot_count_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["serve", "/nowhere", "--expert-cache-slots", "some"])
    assert excinfo.value.code == 2
    assert "'some' is not an expert slot count" in capsys.readouterr().err


def test_the_server_exports_the_cache_in_metrics(moe_install):
    with serving(moe_install, load_text(moe_install), 1, expert_cache=ExpertCacheSlots.fixed(TOP_K)) as server:  # fmt: skip
        reply = client(server).chat.completions.create(
            model="synthetic-gemma4",
            messages=[{"role": "user", "content": "route me"}],
            max_tokens=3,
        )
        assert reply.choices[0].message.content is not None
        text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        stats = service(server).runner.expert_cache_stats()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["turbospark_expert_cache_slots"] == TOP_K
    assert samples["turbospark_expert_cache_misses_total"] == stats.misses > 0
    assert samples["turbospark_expert_cache_hits_total"] == stats.hits
    assert samples["turbospark_expert_cache_read_bytes_total"] == stats.bytes_read
    assert samples["turbospark_expert_cache_resident_bytes"] == stats.resident_bytes


class SwappedGateUp(MutantGemma4):
    """gemma4 declaring its fused gate_up bands the wrong way round: resident
    experts are right, streamed ones read up as gate."""

    @hookimpl
    def turbospark_moe(self, arch):
        spec = self.base.turbospark_moe(arch=arch)
        layers = {}
        for path, projections in spec.layers.items():
            gate, up = projections["gate_proj"], projections["up_proj"]
            layers[path] = {**projections, "gate_proj": up, "up_proj": gate}
        return spec.model_copy(update={"layers": layers})


def test_the_kit_fails_a_family_that_streams_the_wrong_rows(tmp_path):
    registry = FamilyRegistry()
    registry.register(SwappedGateUp("swapped", None, default_registry().get("gemma4").plugin), name="swapped")  # fmt: skip
    try:
        registry.get("swapped").manager().hook.turbospark_build_synthetic_install(
            path=tmp_path, dims={"num_layers": 2, "num_experts": EXPERTS, "top_k_experts": TOP_K}
        )
        kit = FamilyKit.create("swapped", tmp_path, registry)
        with pytest.raises(AssertionError, match=rf"fixed\({TOP_K}\): the prompt's logits differ"):
            FamilyConformance().test_expert_cache_slots_give_identical_logits(kit)
    finally:
        registry.unregister("swapped")


def test_a_fixed_policy_needs_its_count():
    with pytest.raises(ValueError, match="only for it"):
        ExpertCacheSlots(mode="fixed")
    with pytest.raises(ValueError, match="only for it"):
        ExpertCacheSlots(mode="auto", slots=3)


def test_the_engine_batches_rows_over_the_cache_and_fails_them_on_a_lost_file(moe_install, tmp_path):  # fmt: skip
    """Requests decoding together through the engine under fixed(top_k) emit what
    each emits alone with every expert resident; when the install disappears
    mid-decode they fail with the reason, and once it is back the engine serves on."""
    path = tmp_path / "install"
    shutil.copytree(moe_install, path)
    codec = load_text(path)
    runner = Runner.open(path, context_length=256, session_slots=4,
                         expert_cache=ExpertCacheSlots.fixed(TOP_K))  # fmt: skip
    runner.set_prefix_reuse(True)
    engine = Engine(runner, codec, max_batch=3, prefill_budget=4)
    prompts = [[2, 5, 9, 14, 20, 31, 40], [2, 5, 9, 60, 61], [2, 70, 71, 72, 73, 74, 75]]
    config = GenerationConfig(max_tokens=6, temperature=0.0, stop_token_ids=[], chunk_size=3)
    jobs = [Job(ids=p, config=config, emit=Collector()) for p in prompts]
    for job in jobs:
        engine.submit(job)
    while not all(job.emit.done for job in jobs):
        engine.step()
    assert max(job.emit.chunks[-1].stats.batch_size for job in jobs) > 1
    for job, prompt in zip(jobs, prompts, strict=True):
        want = generate(Runner.open(moe_install, context_length=256), codec, prompt, config)
        assert job.emit.error is None and job.emit.tokens == want.tokens

    lost = [Job(ids=[2, 80 + i, 81, 82], config=config, emit=Collector()) for i in range(2)]
    for job in lost:
        engine.submit(job)
    shutil.move(path / "model.safetensors", tmp_path / "away.safetensors")
    for _ in range(200):
        if all(job.emit.done for job in lost):
            break
        engine.step()
    assert all(isinstance(job.emit.error, InstallError) for job in lost)
    assert "install changed under the runner" in str(lost[0].emit.error)
    shutil.move(tmp_path / "away.safetensors", path / "model.safetensors")
    again = Job(ids=prompts[0], config=config, emit=Collector())
    engine.submit(again)
    while not again.emit.done:
        engine.step()
    assert again.emit.error is None and again.emit.tokens == jobs[0].emit.tokens
