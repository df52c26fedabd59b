"""Every benchmark function runs at its tiniest setting and reports positive numbers.

Benchmarks never decide pass/fail on speed: these only check that each one
still runs against the current API and returns the keys the JSON promises.
The HTTP comparison starts two servers and is covered by ``bench/run.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    sys.path.insert(0, str(ROOT))
    try:
        from bench import (
            batch_decode,
            common,
            concurrency,
            constrain,
            dispatch,
            forward,
            host_cost,
            interleaved,
            prefill_cost,
            report,
            server_step,
            session_disk,
            shape_cost,
            steering,
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
        "dispatch": dispatch,
        "forward": forward,
        "host_cost": host_cost,
        "interleaved": interleaved,
        "prefill_cost": prefill_cost,
        "report": report,
        "server_step": server_step,
        "shape_cost": shape_cost,
        "swap": swap,
        "session_disk": session_disk,
        "steering": steering,
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
    assert all(us > 0 for us in out["per_token_us"].values())
    assert out["pluggy_call_us"] > 0 and out["plain_call_us"] > 0


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
    assert row["reload_ms"] > 0 and row["reprefill_ms"] > 0 and row["bytes_per_token"] > 0


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
    assert out["prefill_forwards"] >= 2 and out["decode_forwards"] >= out["full_steps"]
    assert out["completion_tok_s"] > 0 and set(out["time"]) >= {"prefill_s", "decode_full_s"}
    assert out["top_own_cpu_ms_loop"] and out["top_cumulative_cpu_ms_decode"]
    assert bench["server_step"].summary("gemma4", out)


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


def test_shape_cost(bench: dict) -> None:
    """Both attention forms and both GEMMs timed on each case; a forward under
    every setting puts what it replaced back."""
    from turbospark.generation.runner import Runner
    from turbospark.layers import attention

    module = bench["shape_cost"]
    rows = module.ops([(1, 4, 2, 8, 5, 9), (2, 4, 1, 8, 3, 7)], mx.float32, times=2)
    assert [len(r["op"]) + len(r["matmul"]) for r in rows] == [4, 4]
    gemms = module.gemms([(16, 8)], [3, 4], mx.float32, times=2)
    assert [(g["op"], g["M"], len(g["ms"])) for g in gemms] == [
        ("matmul", 3, 2),
        ("addmm", 3, 2),
        ("matmul", 4, 2),
        ("addmm", 4, 2),
    ]
    real_attention, real_open = attention.matmul_attention, Runner.open
    for form, pad in (("op", None), ("matmul", (4, 8))):
        out = module.forwards(bench["gemma4"], form, [(2, 5, 3)], warm_rows=3, pad=pad)
        assert out["rows"][0]["first_ms"] > 0 and out["rows"][0]["again_ms"] > 0
        assert out["settings"]["warm_gemms"]["weights"]
    assert attention.matmul_attention is real_attention and Runner.open == real_open
    real_calls = {type(m): inspect.getattr_static(type(m), "__call__") for m in _model_modules(bench["qwen_gdn"])}  # fmt: skip
    (row,) = module.modules(bench["qwen_gdn"], [(2, 5, 3)])
    assert row["case"] == [2, 5, 3] and {"GatedDeltaNet", "GatedAttention"} <= set(row["ms"])
    assert all(first > 0 and again > 0 for first, again in row["ms"].values())
    assert all(inspect.getattr_static(cls, "__call__") is call for cls, call in real_calls.items())


def _model_modules(path: Path) -> list:
    from turbospark.generation.runner import Runner

    runner = Runner.open(path)
    try:
        return runner.model.modules()
    finally:
        runner.close()


def test_padded_attention_is_the_same_attention() -> None:
    """Padding queries and keys to buckets (masked) changes no output: causal,
    a window's (L, T) mask and a batch's (B, 1, L, T) mask."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench.shape_cost import padded_attention
    finally:
        sys.path.remove(str(ROOT))
    from turbospark.layers import attention

    q = mx.random.normal((2, 4, 7, 16), key=mx.random.key(0))
    k = mx.random.normal((2, 2, 12, 16), key=mx.random.key(1))
    v = mx.random.normal((2, 2, 12, 16), key=mx.random.key(2))
    window = attention.causal_visible(7, 12) & (mx.arange(12)[None] >= mx.arange(7)[:, None])
    rows = (mx.random.uniform(shape=(2, 1, 7, 12), key=mx.random.key(3)) > 0.3) | (mx.arange(12) == 11)  # fmt: skip
    masks: list[mx.array | str] = ["causal", window, rows]
    plain = [attention.matmul_attention(q, k, v, 0.25, m) for m in masks]
    with padded_attention(4, 8):
        for mask, expected in zip(masks, plain, strict=True):
            assert mx.allclose(attention.matmul_attention(q, k, v, 0.25, mask), expected, atol=1e-6)


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


def test_draft_round(bench: dict, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench import draft_round
    finally:
        sys.path.remove(str(ROOT))
    out = draft_round.profile("qwen_gdn", depth=2, tokens=8, reps=1, cache=tmp_path)
    assert out["kernels"]["verify"] > out["kernels"]["step"] > 0
    full, hopeless = out["drafted_100%"], out["drafted_0%"]
    assert full["accepted"] == full["proposed"] > 0 and hopeless["accepted"] == 0
    assert out["off"]["host_us_per_token"] > 0 and full["host_us_by_phase"]["verify_build"] > 0


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
        assert level["batched_tok_s"] > 0 and level["row_by_row_tok_s"] > 0 and level["ratio"] > 0


def test_device_trace_kernels_mode_times_each_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device_trace.py kernels`` calls each attention case at each chunk
    size (CHUNK set while it runs, restored after) and each join-norm case
    with its inputs, one row each. The kernels run only on a GPU: here their
    ops contracts and a stand-in window that counts the calls stand in."""
    sys.path.insert(0, str(ROOT))
    try:
        import bench.device_trace as device_trace
    finally:
        sys.path.remove(str(ROOT))
    from turbospark.layers.cuda import attention as attention_cuda
    from turbospark.layers.cuda import norm as norm_cuda

    seen: list[tuple] = []

    def attention(q, k, v, rows, scale):  # type: ignore[no-untyped-def]
        seen.append(("attention", attention_cuda.CHUNK, q.shape, k.shape, rows.tolist()))
        return attention_cuda.decode_ops(q, k, v, rows, scale)

    def join_norm(h, update, weight, eps, update_weight=None, scale=None):  # type: ignore[no-untyped-def]
        seen.append(("join_norm", update_weight is not None, scale is not None))
        return norm_cuda.join_norm_ops(h, update, weight, eps, update_weight, scale)

    @contextlib.contextmanager
    def window(out: dict, top: int):  # type: ignore[no-untyped-def]
        before = len(seen)
        yield
        out["top_kernels"] = [{"name": "calls", "mean_us": float(len(seen) - before)}]

    monkeypatch.setattr(attention_cuda, "decode", attention)
    monkeypatch.setattr(norm_cuda, "join_norm", join_norm)
    monkeypatch.setattr(device_trace, "traced", window)
    chunk = attention_cuda.CHUNK
    rows = device_trace.kernels(calls=2, chunks=[16, 64], top=5)
    assert chunk == attention_cuda.CHUNK
    cases = device_trace.ATTENTION_CASES
    assert [(r["chunk"], r["kv_heads"], r["group"], r["dim"]) for r in rows[: 2 * len(cases)]] == [
        (c, kv, g, d) for c in (16, 64) for kv, g, d, _, _ in cases
    ]
    assert [(r["update_norm"], r["scale"]) for r in rows[2 * len(cases) :]] == [
        (u, s) for _, u, s in device_trace.JOIN_NORM_CASES
    ]
    assert all(r["mean_us"] == {"calls": 2.0} for r in rows)  # the window holds the calls alone
    first = (16, (1, 8, 1, 512), (1, 2, 2304, 512), [0, 2176])
    assert seen[0] == ("attention", *first)  # the first of three warm-ups


def test_device_trace_summary_of_a_chrome_trace() -> None:
    """A window's kernels group by name without template arguments, the device's
    busy time is their intervals' union (overlaps counted once), and CUDA calls
    rank by summed time; host events are not kernels."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench.device_trace import per_token, summarise
    finally:
        sys.path.remove(str(ROOT))
    events = [
        {"ph": "X", "cat": "kernel", "name": "void mlx::core::cu::gemv<float, 4>(float*)", "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "name": "void mlx::core::cu::gemv<bf16, 8>(bf16*)", "ts": 5.0, "dur": 10.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 30.0, "dur": 2.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 3.0},
        {"ph": "X", "cat": "cuda_driver", "name": "cuModuleLoadData", "ts": 1.0, "dur": 7.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0.0, "dur": 50.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0.0},
    ]  # fmt: skip
    out = summarise(events, wall_us=40.0)
    assert (out["kernels"], out["kernel_us"], out["busy_us"]) == (3, 22.0, 17.0)
    assert out["top_kernels"][0] == {
        "grid_block": [],
        "name": "mlx::core::cu::gemv",
        "n": 2,
        "us": 20.0,
        "mean_us": 10.0,
    }
    assert [a["name"] for a in out["api"]] == ["cuModuleLoadData", "cudaGraphLaunch"]
    assert per_token(out, 2) == {"wall_us": 20.0, "kernels": 1.5, "kernel_us": 11.0, "busy_us": 8.5}


def test_native_stacks_summary_of_py_spy_raw_output() -> None:
    """Samples outside the timed forward, or inside the earlier tokens' feeding,
    are left out; the rest rank by innermost library and frame, and a frame
    counts once a sample inclusively; unnamed addresses keep their library."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench.native_stacks import summarise
    finally:
        sys.path.remove(str(ROOT))
    raw = "\n".join(
        [
            "<module> (x.py:1);timed_forward (p.py:9);mlx::core::eval (libmlx.so);f (libmlx.so);f (libmlx.so) 3",
            "<module> (x.py:1);timed_forward (p.py:9);cublasLtMatmul (libcublasLt.so.13) 2",
            "<module> (x.py:1);timed_forward (p.py:9);0x7f00 (libcuda.so.1) 1",
            "<module> (x.py:1);timed_forward (p.py:9);held_group (p.py:3);malloc (libc.so.6) 5",
            "<module> (x.py:1);other (p.py:2) 7",
            "not a sample line",
        ]
    )  # fmt: skip
    out = summarise(raw, within="timed_forward", outside="held_group")
    assert out["samples"] == 6
    assert out["by_library"] == {"libmlx.so": 3, "libcublasLt.so.13": 2, "libcuda.so.1": 1}
    assert out["top_self"] == [("f (libmlx.so)", 3), ("cublasLtMatmul (libcublasLt.so.13)", 2)]
    assert dict(out["top_inclusive"])["f (libmlx.so)"] == 3
    assert dict(out["top_inclusive"])["timed_forward (python)"] == 6


def test_late_compiles_lists_files_after_the_warm_up_by_phase(tmp_path: Path) -> None:
    """Files written before the warm-up ended are not late; the rest get the
    phase whose end they precede (``after`` past the last)."""
    import os
    import time

    sys.path.insert(0, str(ROOT))
    try:
        from bench.late_compiles import late_files, phase_of
    finally:
        sys.path.remove(str(ROOT))

    ends = {"warm_up": 10.0, "first_request": 11.0, "burst": 15.0, "many_clients": 30.0}
    assert [phase_of(t, ends) for t in (9, 10.5, 14, 29, 31)] == [
        "warm_up", "first_request", "burst", "many_clients", "after",
    ]  # fmt: skip
    started = time.time() - 100
    for name, offset in (("early.ptx", 5), ("burst.ptx", 12), ("late.so", 40)):
        path = tmp_path / "cache" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text("-")
        os.utime(path, (started + offset, started + offset))
    rows = late_files([tmp_path / "cache"], started, ends)
    assert [(row["file"], row["phase"]) for row in rows] == [
        ("burst.ptx", "burst"),
        ("late.so", "after"),
    ]
