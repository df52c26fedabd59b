"""Every benchmark runs at its tiniest setting: the structure it reports, and the
equalities its comparison rests on (same tokens, same prompts, nothing allocated).

Benchmarks never decide pass/fail on speed. These are marked ``bench`` (and
so count as ``slow``): ``uv run pytest -m bench`` runs them, ``-m "not slow"``
leaves them out. The HTTP comparisons start two servers and are run by
``python -m bench.run``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    sys.path.insert(0, str(ROOT))
    try:
        from bench import (
            batch_decode,
            common,
            concurrency,
            constrain,
            decode_reps,
            dispatch,
            encode_cost,
            first_launch,
            forward,
            gpu_kernels,
            host_cost,
            interleaved,
            long_context,
            prefill_cost,
            qmv,
            report,
            run,
            server_step,
            serving,
            session_disk,
            startup,
            steering,
            stream_cost,
            swap,
            thread_profile,
            workload,
        )
    finally:
        sys.path.remove(str(ROOT))
    cache = tmp_path_factory.mktemp("bench-installs")
    return {
        "gemma4": common.install("gemma4", "tiny", "float32", cache),
        "qwen_gdn": common.install("qwen_gdn", "tiny", "float32", cache),
        "qwen4_exp": common.install("qwen4_exp", "tiny", "float32", cache),
        "batch_decode": batch_decode,
        "common": common,
        "concurrency": concurrency,
        "constrain": constrain,
        "decode_reps": decode_reps,
        "dispatch": dispatch,
        "encode_cost": encode_cost,
        "first_launch": first_launch,
        "forward": forward,
        "gpu_kernels": gpu_kernels,
        "host_cost": host_cost,
        "interleaved": interleaved,
        "long_context": long_context,
        "prefill_cost": prefill_cost,
        "qmv": qmv,
        "serving": serving,
        "report": report,
        "run": run,
        "server_step": server_step,
        "swap": swap,
        "session_disk": session_disk,
        "startup": startup,
        "steering": steering,
        "stream_cost": stream_cost,
        "thread_profile": thread_profile,
        "workload": workload,
    }


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_forward(bench: dict, family: str) -> None:
    out = bench["forward"].bench_forward(
        bench[family], prompt_tokens=12, decode_tokens=3, chunk=8, reps=1, library_loops=True,
        uncompiled=True, cost=True,
    )  # fmt: skip
    assert out["prefill_ratio_vs_mlx_lm"] > 0 and out["decode_ratio_vs_mlx_lm"] > 0
    engines = ("ours", "mlx_lm", "ours_generate", "mlx_lm_generate_step", "ours_uncompiled",
               "ours_generate_uncompiled")  # fmt: skip
    for engine in engines:
        assert out["engines"][engine]["prefill_tok_s"] > 0
        assert out["engines"][engine]["decode_tok_s"] > 0
        assert out["roofline"]["fraction"][engine] > 0
    for engine in ("ours", "ours_uncompiled", "mlx_lm"):
        cost = out["step_cost"][engine]
        assert cost["host_us_per_step"] > 0 and cost["host_cpu_us_per_step"] > 0
        assert 0 < cost["kernels"] <= cost["primitives"]
        # On the CPU the fused ops expand; their one-kernel stand-ins count fewer.
        assert 0 < cost["gpu_kernels"] < cost["kernels"]
    # Compiling fuses: fewer kernels per step than the same step uncompiled.
    assert out["step_cost"]["ours"]["kernels"] < out["step_cost"]["ours_uncompiled"]["kernels"]
    assert 0 < out["step_cost"]["ours"]["overlap"] < 1  # produce returned before its step ended


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_gpu_kernels_counts_each_pass(bench: dict, family: str) -> None:
    """A lone row's step, a verify pass and a batched step (the stand-ins
    taking each kernel's arguments, a batch's first rows included)."""
    out = bench["gpu_kernels"].gpu_kernels(bench[family], batch=3)
    for name in ("ours", "mlx_lm", "verify", "batched_decode"):
        assert out[name]["kernels"] > 0, name
    assert out["ours"]["kernels"] < out["ours_uncompiled"]["kernels"]


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_host_cost(bench: dict, family: str) -> None:
    cache = bench[family].parent
    out = bench["host_cost"].host_cost(family, steps=2, rounds=1, cache_dir=cache, size="tiny")
    assert set(out) == {"ours", "ours_uncompiled", "mlx_lm", "ours_batch8"}
    for row in out.values():
        assert row["cpu_us"] > 0 and len(row["cpu_us_rounds"]) == 1
        assert 0 < row["kernels"] <= row["primitives"]
    assert out["ours"]["kernels"] < out["ours_uncompiled"]["kernels"]


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_interleaved(bench: dict, family: str) -> None:
    chat = bench["workload"].ChatWorkload(
        conversations=2, turns=2, user_chars=12, reply_chars=4, max_tokens=2
    )
    out = bench["interleaved"].bench_interleaved(bench[family], chat)
    assert out["speedup_vs_no_pool"] > 0
    # Second turns resume their own session with a pool; without one they cannot.
    assert out["prefill_tokens_saved"] > 0
    assert [t["turn"] for t in out["pool"]["turns"]] == [0, 0, 1, 1]
    summary = bench["report"].headline({"interleaved": out})
    assert set(summary) == {"speedup_vs_no_pool", "prefill_tokens_saved"}


def test_swap(bench: dict) -> None:
    out = bench["swap"].bench_swap(bench["gemma4"], [16, 64], reps=2, compare_mlx_lm=True)
    for row in out["rows"]:
        assert row["swap_ms"] > 0 and row["reprefill_ms"] > 0 and row["mlx_lm_cache_hit_ms"] > 0
        assert row["session_nbytes"] > 0
        # Parking moves references: a swap allocates nothing.
        assert row["active_memory_change_across_swaps_bytes"] == 0


def test_dispatch(bench: dict) -> None:
    out = bench["dispatch"].bench_dispatch(bench["qwen_gdn"], tokens=3, reps=1)
    us = out["per_token_us"]
    assert set(us) == {"direct", "hook", "runner"} and all(t > 0 for t in us.values())
    assert out["hook_overhead_us"] == pytest.approx(us["hook"] - us["direct"])
    assert out["runner_overhead_us"] == pytest.approx(us["runner"] - us["hook"])
    assert out["pluggy_call_us"] > 0 and out["plain_call_us"] > 0


def test_encode_cost(bench: dict) -> None:
    out = bench["encode_cost"].encode_cost((1, 4), 64, 96, n=4, reps=2, dtype=mx.float32)
    assert set(out["rows"]) == {1, 4}
    timings = [t for ops in out["rows"].values() for t in ops.values()] + [out["elementwise"]]
    assert all(0 < t["encode_us"] <= t["wall_us"] for t in timings)


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_steering(bench: dict, family: str) -> None:
    out = bench["steering"].bench_steering(bench[family], tokens=3, reps=1)
    assert out["layers_steered"] >= 1
    assert out["decode_ratio_add"] > 0 and out["decode_ratio_renorm"] > 0
    summary = bench["report"].headline({"steering": out})
    assert summary["steering_decode_ratio_add"] == out["decode_ratio_add"]


def test_machine_record(bench: dict) -> None:
    record = bench["common"].machine()
    assert record["cores"] > 0 and record["blas"] and record["mlx"]


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_session_disk(bench: dict, family: str) -> None:
    out = bench["session_disk"].bench_session_disk(bench[family], [16], reps=1)
    (row,) = out["rows"]
    assert row["history_tokens"] == 16 and row["file_bytes"] == row["bytes_per_token"] * 16 > 0
    assert row["reload_speedup"] == pytest.approx(row["reprefill_ms"] / row["reload_ms"])


def test_concurrency_workload_and_ratios(bench: dict) -> None:
    """The server-free parts of the concurrency benchmark: the chats, the
    percentiles, and ratios refused unless prompts and lengths match."""
    c = bench["concurrency"]
    plan = c.ConcurrencyPlan(clients=(2,), turns=3, reply_tokens=4, user_chars=8)
    chats = c.conversations(2, plan, seed=1)
    assert [len(turns) for turns in chats] == [3, 3]
    # Each turn resends the previous ones with the reply appended.
    assert chats[0][2][:-1] == chats[0][1] + [chats[0][2][-2]]
    assert [m["role"] for m in chats[0][2]] == ["user", "assistant"] * 2 + ["user"]
    assert chats[0] != chats[1]
    assert c.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert c.percentile([7.0], 95) == 7.0

    def run(tok_s: float, prompt: int, completion: int) -> dict:
        rows = [
            {"rep": 0, "client": i, "turn": 0, "prompt_tokens": prompt, "ttft_s": 0.1,
             "completion_tokens": completion}
            for i in range(2)
        ]  # fmt: skip
        return {"wall_s": 1.0, "completion_tokens": 2 * completion, "completion_tok_s": tok_s,
                "ttft_p50_s": 0.1, "ttft_p95_s": 0.2, "retries": 0, "requests": rows}  # fmt: skip

    level = {"turbospark": c.medians([run(30.0, 9, 4)]), "mlx_lm": c.medians([run(20.0, 9, 4)])}
    assert c.compare(level, 4)["tok_s_ratio"] == pytest.approx(1.5)
    level["mlx_lm"] = c.medians([run(20.0, 10, 4)])
    assert "ratio_refused" in c.compare(level, 4) and "tok_s_ratio" not in c.compare(level, 4)
    appended = c.compare(level, 4, append_replies=True)  # each server's own replies re-sent
    assert appended["tok_s_ratio"] == pytest.approx(1.5)
    assert appended["prompt_tokens_ratio"] == pytest.approx(0.9)
    level["mlx_lm"] = c.medians([run(20.0, 9, 3)])
    assert not c.compare(level, 4)["same_completion_tokens"]


@pytest.mark.slow  # a server, a client subprocess, an engine run: ~10 s
def test_server_step(bench: dict) -> None:
    """The server in process, clients in a subprocess: every step recorded, the
    threads' CPU read, and the engine's step alone beside it."""
    plan = bench["concurrency"].ConcurrencyPlan(clients=(2,), turns=2, reply_tokens=6)
    out = bench["server_step"].bench_server_step(bench["gemma4"], 2, plan, steps=5, profile=True)
    assert out["decode_steps"] >= 6 and out["steps_per_batch"].get(2, 0) >= 1
    assert out["loop_cpu_ms_per_step"] > 0 and out["runner_cpu_ms_per_step"] > 0
    assert out["engine_step_ms"] > 0 and out["server_over_engine"] > 0
    # The two clients' second turns prefill together (one group), or apart.
    assert out["prefill_forwards"] >= 1 and out["decode_forwards"] >= out["full_steps"]
    assert out["completion_tok_s"] > 0 and set(out["time"]) >= {"prefill_s", "decode_full_s"}
    assert out["top_own_cpu_ms_loop"] and out["top_cumulative_cpu_ms_decode"]
    assert bench["server_step"].summary("gemma4", out)


@pytest.mark.slow  # a server and a client subprocess: ~5 s
def test_stream_cost(bench: dict) -> None:
    """Every fake chunk reaches every client (a short stream raises); the loop's
    CPU and Python calls a chunk are read."""
    out = bench["stream_cost"].measure(bench["gemma4"], 2, 5, step_ms=2.0, reps=1, top=5)
    assert out["loop_us_per_chunk"] > 0 and out["calls_per_chunk"] > 0
    assert len(out["top_calls_per_chunk"]) == 5


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_prefill_cost(bench: dict, family: str) -> None:
    """Each shape timed twice; the engine's phases timed, then its methods restored."""
    from turbospark.generation.engine import _Batch

    module = bench["prefill_cost"]
    rows = module.shapes(bench[family], cases=[(2, 5, 3), (1, 4, 0)])
    assert [(r["rows"], r["tokens"], r["held"]) for r in rows] == [(2, 5, 3), (1, 4, 0)]
    assert all(r["first_ms"] > 0 and r["again_ms"] > 0 for r in rows)
    feed = _Batch.feed
    out = module.phases(bench[family], clients=2, turns=1, tokens=(6, 5, 3))
    assert _Batch.feed is feed
    assert out["turns"][0]["steps"] >= 3
    assert out["phases"]["group forward"]["calls"] >= 1
    assert out["phases"]["batched decode step"]["calls"] >= 1
    held = module.held(bench[family], new_tokens=5, lengths=(0, 4), reps=1)
    assert [r["held"] for r in held["rows"]] == [0, 4]
    assert all(r["ours_ms"] > 0 and r["mlx_lm_ms"] > 0 for r in held["rows"])


def test_server_step_time_limit(bench: dict) -> None:
    """Past its time limit the measurement's child process stops and the caller
    gets TimeoutError, never a wait (the H200 run once hung here)."""
    plan = bench["concurrency"].ConcurrencyPlan(clients=(2,), turns=1, reply_tokens=4)
    with pytest.raises(TimeoutError, match="did not finish in 0 s"):
        bench["server_step"].bench_server_step(bench["gemma4"], 2, plan, time_limit_s=0.01)


def test_thread_sampler_keeps_threads_and_phases_apart(bench: dict) -> None:
    """Each watched thread's CPU time goes to its own phase's profile, under the
    function it was running; a thread whose phase is None is not counted.
    A process-wide cProfile being on (one per process from Python 3.12) changes nothing."""
    import cProfile
    import threading
    import time

    def spin(until: float) -> None:
        while time.monotonic() < until:
            pass

    phases = {"a": "spinning", "b": None}
    until = time.monotonic() + 0.3
    threads = {name: threading.Thread(target=spin, args=(until,)) for name in phases}
    sampler = bench["thread_profile"].ThreadSampler(interval=0.002)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for name, thread in threads.items():
            thread.start()
            sampler.watch(thread.ident, lambda name=name: phases[name])
        sampler.start()
        for thread in threads.values():
            thread.join()
        sampler.stop()
    finally:
        profiler.disable()
    assert set(sampler.profiles) == {"spinning"}
    own = dict((name, ms) for name, ms, _ in sampler.profiles["spinning"].top("own"))
    spun = [ms for name, ms in own.items() if name.endswith(":spin")]
    assert spun and spun[0] > 0.5 * sum(own.values())


def test_constrain(bench: dict) -> None:
    """Both libraries (xgrammar when installed: ``uv sync --group bench``) accept
    the whole document on a small vocabulary and report positive costs."""
    out = bench["constrain"].bench_constrain(reps=1, vocab_size=3000)
    assert out["vocab_size"] == 3000
    for library in ("llguidance", "xgrammar"):
        result = out[library]
        if "error" in result:
            assert library == "xgrammar" and "uv sync --group bench" in result["error"]
            continue
        for name in ("json_schema", "json_object"):
            row = result[name]
            assert row["accepting"] and row["mask_us"] > 0 and row["step_us"] > 0, (library, row)


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_draft(bench: dict, family: str) -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench import draft
    finally:
        sys.path.remove(str(ROOT))
    out = draft.bench_draft(bench[family], depths=[2], accuracies=[1.0, 0.0], tokens=6, reps=1)
    assert out["ngram_copy"]["tok_s"] > 0 and out["ngram_copy"]["off_tok_s"] > 0
    full, hopeless = out["curve"]
    assert full["acceptance"] == 1.0 and full["output_equals_off"]
    assert full["reference_equals_off"] and full["reference_rounds"] == 1  # float32: off's reply
    assert hopeless["accepted"] == 0 and hopeless["speedup_vs_off"] > 0
    assert draft.summary(out)["draft_full_acceptance_depth"] == 2


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_draft_reference_is_a_fixed_point_in_bf16(bench: dict, family: str, tmp_path: Path) -> None:
    """In bf16 a verify pass rounds differently from one-token steps; the
    reference the 100% oracle replays must still be one the drafted path
    reproduces, so replaying it accepts every draft."""
    path = bench["common"].install(family, "tiny", "bfloat16", tmp_path)
    sys.path.insert(0, str(ROOT))
    try:
        from bench import draft
    finally:
        sys.path.remove(str(ROOT))
    from turbospark.generation.drafters import ReplayDrafter
    from turbospark.generation.generate import GenerationConfig, generate
    from turbospark.generation.runner import Runner
    from turbospark.text import load_text

    runner, codec = Runner.open(path, context_length=96), load_text(path)
    config = GenerationConfig(max_tokens=48, stop_token_ids=[])
    prompt = bench["common"].random_tokens(16, runner.vocab_size, seed=3)
    reference, recordings, settled = draft.fixed_point_reference(runner, codec, prompt, config, 4)
    done = generate(
        runner, codec, prompt, config, drafter=ReplayDrafter(reference, runner.vocab_size, 4)
    )
    assert settled and recordings >= 1 and done.tokens == reference[len(prompt) :]
    assert done.stats.draft_proposed > 0
    assert done.stats.draft_accepted == done.stats.draft_proposed


def test_draft_mtp(bench: dict, tmp_path: Path) -> None:
    path = bench["common"].install("qwen_gdn", "tiny", "float32", tmp_path, mtp=True)
    sys.path.insert(0, str(ROOT))
    try:
        from bench import draft
    finally:
        sys.path.remove(str(ROOT))
    (row,) = draft.bench_mtp(path, depths=[2], tokens=6, reps=1)
    assert row["output_equals_off"] and row["proposed"] >= row["accepted"] >= 0
    assert row["tok_s"] > 0 and row["off_tok_s"] > 0 and row["proposal_ms"] > 0


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_long_context(bench: dict, family: str) -> None:
    out = bench["long_context"].bench_long_context(
        bench[family], prompt_lengths=(24, 40), decode_tokens=8, chunk=16
    )
    assert [r["prompt_tokens"] for r in out["rows"]] == [24, 40]
    for row in out["rows"]:
        assert row["tokens_match"]  # same weights, same greedy ids in both engines
        for engine in row["engines"].values():
            assert len(engine["step_s"]) == 8
            assert engine["peak_bytes"] >= engine["loaded_bytes"] > 0
            assert engine["max_over_median_step"] >= 1
        assert row["peak_memory_ratio_vs_mlx_lm"] > 0 and row["decode_ratio_vs_mlx_lm"] > 0
    assert bench["long_context"].summary(out)
    assert bench["report"].figures("long_context", out)


def test_decode_reps(bench: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """Each engine's repetitions decode the same ids; a count below one is refused by name."""
    reps = bench["decode_reps"]
    for engine in reps.ENGINES:
        out = reps.decode_reps(
            bench["gemma4"], engine, prompt_tokens=24, tokens=6, chunk=16, reps=2
        )
        assert len(out["tok_s"]) == 2 and all(rate > 0 for rate in out["tok_s"])
        assert out["same_tokens"]
    with pytest.raises(SystemExit):
        reps.main([str(bench["gemma4"]), "--tokens", "0"])
    assert "--tokens must be at least 1" in capsys.readouterr().err


def test_first_launch(bench: dict) -> None:
    """An install's first run and its kept run, each in a fresh process over
    its own caches: the open, the warm-up's phases (prefill, then decode from
    a lone row up), and nothing compiled on the CPU; mlx-lm's load and generates."""
    out = bench["first_launch"].first_launch({"float": bench["gemma4"]}, bench["gemma4"], 300)
    assert list(out["float"]) == ["first", "kept"]
    for row in out["float"].values():
        assert 0 < row["open_s"] < row["process_s"] and row["warm_up_s"] > 0
        phases = list(row["phases"])
        assert phases[0] == "prefill" and "decode B=1" in phases
        assert row["our_compiles"] == {"count": 0, "s": 0}
        assert row["kernels"] == {"turbospark": 0, "mlx": 0, "mlx_entries": []}
    assert out["mlx_lm"]["first_generate_s"] > 0 and out["mlx_lm"]["load_s"] > 0


def test_first_launch_refuses_a_width_it_has_no_install_for(
    bench: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench["first_launch"].main(["--bits", "3"])
    assert "--bits takes 4, 8 or 0 (the float install)" in capsys.readouterr().err


def test_qmv_products_follow_the_size(bench: dict) -> None:
    """``tp8b``'s products are the ones docs/CUDA.md's sweep recorded; a
    step's sum counts each layer's products *layers* times and the head once."""
    qmv = bench["qmv"]
    assert qmv.products("tp8b") == {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "head": (32768, 4096),
    }
    assert qmv.products("large")["o"] == (2048, 2048)
    timed = [
        {"bits": 8, "rows": 1, "variant": "1,4,1", "product": name, "kernel_us": 1.0, "op_us": 2.0}
        for name in ("qkv", "head")
    ]
    assert qmv.step_us(timed, 16) == {(8, 1, "1,4,1"): (17.0, 34.0)}


def test_host_sizes_keep_their_models_layout(bench: dict) -> None:
    """A host size is its model's layer layout at tiny widths, so its GPU
    decode is what the host allows at that depth: only widths differ."""
    sizes, widths = bench["common"].SIZES, bench["common"]._HOST_WIDTHS
    for family in ("gemma4", "qwen_gdn"):
        model, host = sizes[family]["tp8b"], sizes[family]["tp8b_host"]
        assert host.keys() == model.keys()
        assert {k: v for k, v in host.items() if k not in widths} == {
            k: v for k, v in model.items() if k not in widths
        }
        assert host["hidden_size"] < model["hidden_size"]


def test_warm_up_line_is_read_from_our_servers_log(tmp_path: Path) -> None:
    """A concurrency result keeps our server's warm-up line (each round's
    time); a log without one gives None."""
    sys.path.insert(0, str(ROOT))
    from bench.serving import warm_up_line

    log = tmp_path / "serve.log"
    log.write_text(
        "INFO:     Started server process\n"
        "INFO:     turbospark.generation.engine: warmed up in 2.5 s (alone 0.4 s, groups 0.6 s, "
        "groups with history 0.5 s, batch decode 1.0 s)\n"
    )
    assert warm_up_line(log) == (
        "warmed up in 2.5 s (alone 0.4 s, groups 0.6 s, groups with history 0.5 s, "
        "batch decode 1.0 s)"
    )
    log.write_text("INFO: no warm-up here\n")
    assert warm_up_line(log) is None
    assert warm_up_line(tmp_path / "missing.log") is None


def test_gpu_state_reads_nvidia_smi_and_is_none_without_it(
    bench: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result's GPU clocks come from nvidia-smi's query, field by field
    (the older name of the clock-reasons field where the newer one is
    refused); with no nvidia-smi there is none."""
    common = bench["common"]
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$*" in *clocks_event_reasons*) exit 2;; esac\n'
        "echo '1980 MHz, 2619 MHz, 312.5 W, 41, 0x0000000000000000'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
    values = ["1980 MHz", "2619 MHz", "312.5 W", "41", "0x0000000000000000"]
    assert common.gpu_state() == dict(zip(common.GPU_FIELDS, values, strict=True))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert common.gpu_state() is None


def test_experts(bench: dict, tmp_path: Path) -> None:
    path = bench["common"].install("gemma4", "tiny_moe", "float32", tmp_path)
    sys.path.insert(0, str(ROOT))
    try:
        from bench.experts import bench_experts
    finally:
        sys.path.remove(str(ROOT))
    out = bench_experts(path, prompt_tokens=8, decode_tokens=3, reps=1)
    assert set(out["engines"]) == {"fixed(2)", "fixed(4)", "all"}
    for row in out["engines"].values():
        assert row["decode_tok_s"] > 0 and row["same_tokens_as_all"]
        assert 0 <= row["hit_rate"] <= 1 and row["resident_expert_bytes"] > 0


def test_batch_decode(bench: dict) -> None:
    """qwen4_exp, dense (8-token prompts) and sparse (20: past the tiny budget's 15)."""
    out = bench["batch_decode"].bench_batch_decode(
        bench["qwen4_exp"], batches=(2,), prompts=(8, 20), steps=2, reps=1
    )
    assert set(out["levels"]) == {"P=8,B=2", "P=20,B=2"}
    for level in out["levels"].values():
        ratio = level["batched_tok_s"] / level["row_by_row_tok_s"]
        assert level["ratio"] == pytest.approx(ratio) and ratio > 0


def test_the_entry_point_writes_one_file_a_section(bench: dict, tmp_path: Path) -> None:
    """``python -m bench.run``: each section's file under its plain name, with the
    machine record and plan beside the result, and ``bench.report`` reads it back."""
    run, out = bench["run"], tmp_path / "out"
    argv = ["--device", "cpu", "--quick", "--family", "qwen_gdn", "--only", "dispatch"]
    assert run.main([*argv, "--out", str(out), "--cache-dir", str(bench["qwen_gdn"].parent)]) == 0
    (written,) = out.iterdir()
    assert written.name == "dispatch_qwen_gdn.json"
    row = json.loads(written.read_text())
    assert (row["section"], row["family"], row["plan"], row["dtype"]) == (
        "dispatch", "qwen_gdn", "quick", "float32",
    )  # fmt: skip
    assert row["machine"]["device"] == "Device(cpu, 0)" and row["machine"]["blas"]
    assert row["plan_settings"]["dispatch_tokens"] == run.QUICK.dispatch_tokens
    assert set(row["result"]["per_token_us"]) == {"direct", "hook", "runner"}
    assert (
        bench["report"].main([str(out)]) == 0 and bench["report"].main([str(out), "--table"]) == 0
    )
    ((_, value, _),) = bench["report"].figures("dispatch", row["result"])
    assert (
        value
        == f"{row['result']['hook_overhead_us']:.0f}, {row['result']['runner_overhead_us']:.0f}"
    )
    assert run.result_name("constrain", "-") == "constrain.json"
    resent = run.ConcurrencyPlan(append_replies=True)
    assert (
        run.result_name("concurrency", "gemma4", resent) == "concurrency_replies_resent_gemma4.json"
    )
    longer = run.ConcurrencyPlan(append_replies=True, turns=2, reply_tokens=256)
    assert (
        run.result_name("concurrency", "gemma4", longer)
        == "concurrency_replies_resent_2x256_gemma4.json"
    )
    assert (
        run.result_name("concurrency", "gemma4", run.ConcurrencyPlan()) == "concurrency_gemma4.json"
    )
    plan = run.ConcurrencyPlan()
    assert (plan.turns, plan.reply_tokens) == bench["report"].DEFAULT_CHAT
    assert run.results_dir("cpu") == ROOT / "bench" / "results" / "cpu"


def test_the_entry_point_narrows_sections_and_passes_serve_args(
    bench: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--long-context-length`` (repeatable) and ``--startup-reps`` replace the
    plan's, ``--serve-arg`` reaches the concurrency section's server; a length or
    a count below 1 is refused in one line."""
    run, seen = bench["run"], {}
    monkeypatch.setitem(
        run.RUN, "long_context", lambda ctx, _: seen.update(lengths=ctx.plan.long_context_lengths)
    )
    monkeypatch.setitem(run.RUN, "startup", lambda ctx, _: seen.update(reps=ctx.plan.startup_reps))
    monkeypatch.setitem(
        run.RUN, "concurrency", lambda ctx, _: seen.update(serve_args=ctx.plan.serve_args)
    )
    argv = ["--device", "cpu", "--quick", "--family", "gemma4", "--out", str(tmp_path)]
    argv += ["--only", "long_context", "--only", "startup", "--only", "concurrency"]
    narrowed = ["--long-context-length", "48", "--long-context-length", "96", "--startup-reps", "1"]
    narrowed += ["--serve-arg=--cuda-graphs=off", "--serve-arg=--max-queue=9"]
    assert run.main([*argv, *narrowed]) == 0
    assert seen == {
        "lengths": (48, 96),
        "reps": 1,
        "serve_args": ("--cuda-graphs=off", "--max-queue=9"),
    }
    for flag in (["--long-context-length", "0"], ["--startup-reps", "0"]):
        with pytest.raises(SystemExit):
            run.main([*argv, *flag])
        assert "must be at least 1" in capsys.readouterr().err


def test_committed_results_have_plain_names_and_a_machine() -> None:
    """Reference results: ``<section>_<family>.json`` (or ``<section>.json``) a device,
    each a section the entry point has, run on the machine it names."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench.concurrency import ConcurrencyPlan
        from bench.run import SECTIONS, result_name
    finally:
        sys.path.remove(str(ROOT))
    results = ROOT / "bench" / "results"
    files = sorted(results.rglob("*"))
    assert files and all(f.is_dir() or f.suffix == ".json" for f in files), files
    for file in (f for f in files if f.is_file()):
        row = json.loads(file.read_text())
        assert row["section"] in SECTIONS and row["machine"]["mlx"], file
        chats = ConcurrencyPlan(**row["plan_settings"].get("concurrency", {}))
        assert file.name == result_name(row["section"], row["family"], chats), file
        device = file.relative_to(results).parts[0]
        assert device in ("cpu", "gpu") and (device == "cpu") == ("cpu" in row["machine"]["device"])


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_concurrency_appending_replies_as_received(
    bench: dict, family: str, tmp_path: Path
) -> None:
    """Both servers, one client, two turns, each turn carrying the reply it was
    sent: the cached tokens of every turn reported for both, and ours reuses
    the first turn as far as the template renders it again."""
    c = bench["concurrency"]
    plan = c.ConcurrencyPlan(clients=(1,), turns=2, reply_tokens=4, append_replies=True)
    out = c.bench_concurrency(bench[family], plan, tmp_path)
    level = out["levels"]["1"]
    assert out["settings"]["append_replies"] is True
    for kind in c.KINDS:
        assert [t["turn"] for t in level[kind]["cached_by_turn"]] == [0, 1]
    first, second = level["turbospark"]["cached_by_turn"]
    if family == "qwen_gdn":
        # The bench turns thinking off for both servers: Qwen3.5's template pre-fills
        # an empty think block the history then drops, so turn 2 leaves turn 1's
        # session after the assistant header both renderings share, and resumes
        # from the checkpoint kept there.
        from turbospark.text import load_text

        codec = load_text(bench[family])
        ask = [{"role": "user", "content": "hi"}]
        kwargs = bench["serving"].TEMPLATE_KWARGS
        prompt = codec.encode(codec.apply_chat_template(ask, **kwargs))
        history = codec.encode(
            codec.apply_chat_template(
                [*ask, {"role": "assistant", "content": "ok"}, *ask],
                add_generation_prompt=False,
                **kwargs,
            )
        )
        shared = next(i for i, (a, b) in enumerate(zip(prompt, history, strict=False)) if a != b)
        assert second["cached_tokens"] == first["prompt_tokens"] - (len(prompt) - shared)
    else:  # Gemma's template trims a reply: this one (blank) is not rendered as sent
        assert second["cached_tokens"] >= first["prompt_tokens"]
    assert any("cached/prompt tokens per turn" in line for line in c.summary(out))


def test_startup(bench: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One cold launch of each server, each through the cache-bounding launcher:
    every time in order (ready, then the first token) and the ratio from the
    two, printed as the entry point prints it."""
    out = bench["startup"].bench_startup(bench["gemma4"], 1, tmp_path, cache_limit="256MiB")
    assert out["mlx_cache_limit"] == "256MiB"  # both launched through bench.capped
    for kind in bench["startup"].KINDS:
        (row,) = out[kind]["per_rep"]
        assert 0 < row["ready_s"] < row["first_token_s"], kind
        assert 0 < row["first_request_ttft_s"] < row["first_token_s"], kind
    assert out["turbospark"]["warm_s"] >= out["turbospark"]["ready_s"]
    ratio = out["mlx_lm"]["first_token_s"] / out["turbospark"]["first_token_s"]
    assert out["first_token_ratio"] == out["first_token_ratio_per_rep"][0] == ratio
    bench["report"].print_section("startup", "gemma4", out)
    assert "launch to first token" in capsys.readouterr().out
    assert bench["report"].figures("startup", out)


PROBE = """
import sys
import mlx.core as mx
print(__name__, mx.set_cache_limit(0), *sys.argv[1:])
"""


def test_capped_launcher_bounds_mlx_then_runs_the_module(bench: dict, tmp_path: Path) -> None:
    """``bench.capped`` sets MLX's buffer cache limit, then runs the module as
    ``python -m`` would, its arguments untouched (``-m`` and ``--cache-limit``
    among them), from any working directory; the servers' command lines go
    through it only when a limit is given."""
    import os
    import subprocess

    serving = bench["serving"]
    (tmp_path / "probe_limit.py").write_text(PROBE)
    env = serving.server_env("123MiB")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    args = ["-m", "x", "--cache-limit", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.capped", "--cache-limit", "123MiB", "-m", "probe_limit",
         *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout.split() == ["__main__", str(123 << 20), *args]
    refused = subprocess.run(
        [sys.executable, "-m", "bench.capped", "--cache-limit=-1", "-m", "probe_limit"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "argument --cache-limit: '-1': a size cannot be negative" in refused.stderr

    path = bench["gemma4"]
    for kind, module in [("turbospark", "turbospark"), ("mlx_lm", "mlx_lm.server")]:
        plain = serving.server_command(kind, path, 8000, 2)
        capped = serving.server_command(kind, path, 8000, 2, cache_limit="8GiB")
        assert plain[1:3] == ["-m", module]
        assert capped[1:7] == ["-m", "bench.capped", "--cache-limit", "8GiB", "-m", module]
        assert capped[7:] == plain[3:]
    assert serving.server_env(None) == dict(os.environ)


def test_a_bad_cache_limit_is_refused_before_any_server_starts() -> None:
    """``bench/concurrency.py --cache-limit`` reads as a size when parsed:
    a bad one is a one-line usage error, before an install is built or a
    server launched."""
    import subprocess

    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "concurrency.py"), "--cache-limit", "8QB"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "argument --cache-limit: '8QB' is not a size: use bytes or a unit like 512MiB, 2GiB, 1.5GB"
        )
    )
