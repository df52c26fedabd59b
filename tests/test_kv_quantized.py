"""The quantized K/V cache (``--kv-bits``): mlx-lm's logits at the same
settings, and every path a session takes (chunked, batched, drafted, parked,
on disk, steered) equal to the plain path under the same setting; sessions
smaller by the expected ratio; other settings and bad values refused."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache
from mlx_lm.utils import load_model

from helpers import batched_greedy, serve_turn, verify_and_cut
from turbospark import InvalidInput, ReuseReason, Runner, build_synthetic_install
from turbospark.cli import main
from turbospark.policies.steering import SteeringPolicy
from turbospark.server import ThreadedServer, create_app
from turbospark.server.worker import RunnerWorker
from turbospark.sessions.session_file import read_session
from turbospark.state.kv import KVComponent, KVQuantization, LayerKV, QuantizedRows
from turbospark.text import load_text

GROUP = 32  # divides both installs' head dims (32; Gemma 4's global heads 64)
PROMPT = np.random.default_rng(1).integers(0, 128, 20).tolist()
DECODE = [17, 3, 99]
ATOL = 1e-4


@pytest.fixture(scope="module", params=["qwen_gdn", "gemma4"])
def install(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny install whose attention head dims *GROUP* divides; Gemma 4's has
    a sliding window shorter than the prompt (its ring trims)."""
    family = request.param
    path = tmp_path_factory.mktemp(family)
    dims = (
        {"num_layers": 2, "sliding_window": 8, "head_dim": 32, "global_head_dim": 64}
        if family == "gemma4"
        else {"num_layers": 4}
    )
    build_synthetic_install(family, path, vocab_size=128, model_id=f"kvq-{family}", seed=3, **dims)
    return path


def quantized(path: Path, bits: int = 4, **options: object) -> Runner:
    runner = Runner.open(path, kv_bits=bits, kv_group_size=GROUP, **options)
    runner.set_prefix_reuse(True)
    return runner


def mlx_lm_logits(path: Path, bits: int | None) -> np.ndarray:
    """mlx-lm's logits at every prompt position, then after each decode token,
    with its ``QuantizedKVCache`` for every attention layer (the prompt fits
    no window of mlx-lm's, so the windowed layers' plain cache is exact)."""
    model, _ = load_model(path)
    cache = model.make_cache()
    if bits is not None:
        cache = [
            QuantizedKVCache(group_size=GROUP, bits=bits)
            if isinstance(c, KVCache | RotatingKVCache)
            else c
            for c in cache
        ]
    rows = [model(mx.array(PROMPT)[None], cache=cache)[0]]
    for token in DECODE:
        rows.append(model(mx.array([[token]]), cache=cache)[0])
    return np.array(mx.concatenate(rows).astype(mx.float32))


def sequential(runner: Runner, tokens: list[int]) -> np.ndarray:
    """The logits after every token, fed one at a time."""
    return np.stack([np.array(runner.produce(t, i)) for i, t in enumerate(tokens)])


@pytest.mark.parametrize("bits", [8, 4])
def test_logits_match_mlx_lm_quantized_cache(install: Path, bits: int) -> None:
    runner = quantized(install, bits)
    got = sequential(runner, PROMPT + DECODE)
    np.testing.assert_allclose(got, mlx_lm_logits(install, bits), atol=ATOL)
    layer = runner.sessions()[0].state["kv"].layers[0]
    assert isinstance(layer.keys, QuantizedRows) and layer.keys.data.dtype == mx.uint32
    if bits == 4:  # the cache is quantized: full-precision K/V give other logits
        assert not np.allclose(got, mlx_lm_logits(install, None), atol=ATOL)


def test_chunked_equals_sequential(install: Path) -> None:
    tokens = PROMPT + DECODE
    want = sequential(quantized(install), tokens)
    runner, got, start = quantized(install), [], 0
    for size in (7, 1, 9, 3):  # crosses Gemma 4's window mid-chunk
        got.append(np.array(runner.prefill_chunk(tokens[start : start + size], start)))
        start += size
    got += [np.array(runner.produce(t, start + i)) for i, t in enumerate(DECODE)]
    ends = [6, 7, 16, 19, 20, 21, 22]
    np.testing.assert_allclose(np.stack(got), want[ends], atol=ATOL)


def test_batched_equals_alone(install: Path) -> None:
    """Rows of three lengths (left padding; Gemma 4's ring past its window)
    merged and decoded together give each row's logits alone."""
    prompts = [PROMPT[:5], PROMPT[:12], PROMPT]
    together = batched_greedy(quantized(install, session_slots=3), prompts, steps=4)
    for row, prompt in enumerate(prompts):
        alone = quantized(install)
        alone.prefill_chunk(prompt, 0, logits=False)
        token, position = prompt[-1], len(prompt)  # batched_greedy's first step
        for step in range(4):
            logits = alone.produce(token, position)
            np.testing.assert_allclose(np.array(together[step][row]), np.array(logits), atol=ATOL)
            token, position = int(mx.argmax(logits)), position + 1


def test_engine_rows_joining_and_leaving_equal_each_alone(install: Path) -> None:
    """The engine's continuous batching (rows join mid-decode, leave when done,
    each prefilled in chunks) over quantized K/V writes what each request
    writes alone, and the sessions it leaves resume exactly."""
    from turbospark.generation.engine import Engine, Job
    from turbospark.generation.generate import GenerationConfig, generate

    codec = load_text(install)
    runner = quantized(install, session_slots=4)
    engine = Engine(runner, codec, max_batch=3, prefill_budget=4)
    prompts = [PROMPT[:7], PROMPT[3:8], PROMPT, [*PROMPT[:10], 90]]
    configs = [
        GenerationConfig(max_tokens=n, temperature=0.0, stop_token_ids=[], chunk_size=3)
        for n in (10, 4, 8, 6)
    ]
    chunks: list[list] = [[] for _ in prompts]
    jobs = [
        Job(ids=list(p), config=c, emit=chunks[i].append)
        for i, (p, c) in enumerate(zip(prompts, configs, strict=True))
    ]
    pending = list(zip([0, 0, 2, 5], jobs, strict=True))
    for step in range(500):
        while pending and pending[0][0] <= step:
            engine.submit(pending.pop(0)[1])
        engine.step()
        if not pending and all(c and getattr(c[-1], "finish_reason", None) for c in chunks):
            break
    assert not [x for c in chunks for x in c if isinstance(x, Exception)]
    assert max(c[-1].stats.batch_size for c in chunks) > 1, "no two rows decoded together"
    for got, prompt, config in zip(chunks, prompts, configs, strict=True):
        want = generate(quantized(install), codec, prompt, config)
        assert [c.token for c in got if c.token is not None] == want.tokens, prompt


def test_batched_rows_extend_filter_and_extract_exactly(install: Path) -> None:
    """Quantized rows through a batch's merge, extend, filter and extract come
    out as the very arrays they went in as."""
    runner = quantized(install, session_slots=3)
    sessions = []
    for prompt in (PROMPT[:5], PROMPT[:12], PROMPT):
        session = runner.checkout()
        runner.feed(session, prompt, 0)
        sessions.append(session)
    before = [s.state["kv"].snapshot() for s in sessions]
    batch = KVComponent.merge([sessions[0].state["kv"]])
    batch.extend(KVComponent.merge([s.state["kv"] for s in sessions[1:]]))
    batch.filter([2, 0])
    for row, original in ((0, before[2]), (1, before[0])):
        position = sessions[2 if row == 0 else 0].position
        after = batch.extract(row, position, 0, None).snapshot()
        assert after.keys() == original.keys()
        for name, array in original.items():
            assert mx.array_equal(after[name], array), name


def test_drafted_rewind_equals_uninterrupted(install: Path) -> None:
    """A verify pass cut back (drafted decoding's rewind) leaves the state a
    plain feed of the kept tokens leaves."""
    drafts, keep = [40, 41, 42, 43], 2
    logits, after, _ = verify_and_cut(quantized(install), PROMPT, drafts, keep)
    plain = quantized(install)
    plain.prefill_chunk(PROMPT, 0)
    want = plain.prefill_chunk(drafts, len(PROMPT), logits=True)
    plain.reset()
    plain.prefill_chunk(PROMPT + drafts[:keep], 0)
    np.testing.assert_allclose(np.array(logits[-1]), np.array(want), atol=ATOL)
    np.testing.assert_allclose(
        np.array(after), np.array(plain.produce(40, len(PROMPT) + keep)), atol=ATOL
    )


def test_mtp_drafts_under_a_quantized_cache(mtp_install: Path) -> None:
    """MTP drafting (its rounds rewind the quantized K/V) writes what plain
    greedy decoding writes under the same cache; the head's own one-layer
    cache stays full precision (docs/SESSIONS.md)."""
    from turbospark.generation.generate import GenerationConfig, generate
    from turbospark.policies import DraftPolicies

    codec = load_text(mtp_install)
    config = GenerationConfig(max_tokens=12, temperature=0.0)
    plain = generate(quantized(mtp_install), codec, PROMPT, config)
    drafted = generate(quantized(mtp_install, draft=DraftPolicies.mtp()), codec, PROMPT, config)
    assert drafted.tokens == plain.tokens


def test_parked_and_resumed_equals_uninterrupted(install: Path) -> None:
    """A session parked in the pool (by reference) and resumed, or restored
    from a snapshot, continues as an uninterrupted one."""
    runner = quantized(install, session_slots=2)
    serve_turn(runner, PROMPT)
    snapshot = runner.snapshot()
    serve_turn(runner, [5, 6, 7, 8])  # another conversation parks ours
    kept, logits = serve_turn(runner, [*PROMPT, *DECODE])
    assert kept == len(PROMPT), runner.last_reuse
    fresh = quantized(install)
    fresh.prefill_chunk(PROMPT, 0)
    want = fresh.prefill_chunk(DECODE, len(PROMPT))
    np.testing.assert_allclose(np.array(logits), np.array(want), atol=ATOL)
    runner.restore(snapshot)
    again = runner.prefill_chunk(DECODE, len(PROMPT))
    np.testing.assert_allclose(np.array(again), np.array(want), atol=ATOL)


def test_resumed_from_disk_equals_uninterrupted(install: Path, tmp_path: Path) -> None:
    runner = quantized(install, session_slots=2, session_dir=tmp_path)
    serve_turn(runner, PROMPT)
    runner.close()
    (path,) = sorted(tmp_path.glob("*.safetensors"))
    meta, snapshot = read_session(path, runner.session_disk.model)
    assert meta.model.kv_quantization == KVQuantization(bits=4, group_size=GROUP)
    stored = {name: array.dtype for name, array in snapshot.arrays["kv"].items()}
    assert stored["0.keys"] == mx.uint32 and "0.keys.scales" in stored, stored
    restarted = quantized(install, session_slots=2, session_dir=tmp_path)
    kept, logits = serve_turn(restarted, [*PROMPT, *DECODE])
    assert restarted.last_reuse.reason == ReuseReason.RESTORED_FROM_DISK, restarted.last_reuse
    fresh = quantized(install)
    fresh.prefill_chunk(PROMPT, 0)
    want = fresh.prefill_chunk(DECODE, kept)
    np.testing.assert_allclose(np.array(logits), np.array(want), atol=ATOL)


@pytest.mark.parametrize(("written", "opened"), [(8, 4), (None, 4), (8, None)])
def test_a_session_of_other_kv_settings_is_refused(
    install: Path, tmp_path: Path, written: int | None, opened: int | None
) -> None:
    """Never mixed: the file is refused, named, set aside with the flags that
    would load it, and the prompt is computed afresh."""
    runner = Runner.open(install, session_slots=2, session_dir=tmp_path, kv_bits=written, kv_group_size=GROUP)  # fmt: skip
    serve_turn(runner, PROMPT)
    runner.close()
    other = Runner.open(install, session_slots=2, session_dir=tmp_path, kv_bits=opened, kv_group_size=GROUP)  # fmt: skip
    other.set_prefix_reuse(True)
    ((name, reason),) = other.session_disk.rejected
    assert reason == "kv_quantization_differs"
    note = (tmp_path / "rejected" / name).with_suffix(".reason").read_text()
    fix = "no --kv-bits" if written is None else f"--kv-bits {written} --kv-group-size {GROUP}"
    assert "kv_quantization" in note and fix in note, note
    kept, _ = serve_turn(other, [*PROMPT, *DECODE])
    assert kept == 0 and other.last_reuse.reason != ReuseReason.RESTORED_FROM_DISK


def test_snapshot_of_other_kv_settings_is_refused(install: Path) -> None:
    full = Runner.open(install)
    full.prefill_chunk(PROMPT, 0)
    runner, fresh = quantized(install), quantized(install)
    runner.prefill_chunk(PROMPT[:5], 0)
    with pytest.raises(InvalidInput, match="K/V setting it was written under"):
        runner.restore(full.snapshot())
    assert runner.position == 5  # the session it refused to overwrite goes on unchanged
    fresh.prefill_chunk(PROMPT[:5], 0)
    np.testing.assert_allclose(
        np.array(runner.prefill_chunk(PROMPT[5:], 5)),
        np.array(fresh.prefill_chunk(PROMPT[5:], 5)),
        atol=ATOL,
    )


@pytest.mark.parametrize(("bits", "per_value"), [(8, 1.25), (4, 0.75)])
def test_sessions_are_smaller_by_the_expected_ratio(
    install: Path, bits: int, per_value: float
) -> None:
    """A float32 K/V value takes 4 bytes; quantized, ``bits / 8`` plus a scale
    and a bias (4 bytes each) per group of 32: 1.25 and 0.75 bytes. Recurrent
    state keeps its size, and the pool's cap counts the smaller sessions."""
    full = Runner.open(install)
    full.prefill_chunk(PROMPT, 0)
    small = quantized(install, bits)
    small.prefill_chunk(PROMPT, 0)
    (plain,), (packed,) = full.sessions(), small.sessions()
    for name in plain.state:
        if isinstance(plain.state[name], KVComponent):
            assert packed.state[name].nbytes * 4 == plain.state[name].nbytes * per_value
        else:
            assert packed.state[name].nbytes == plain.state[name].nbytes
    assert packed.nbytes < plain.nbytes
    # A parked-memory cap one full-precision session overflows holds a quantized one.
    cap = plain.nbytes - 1
    for runner in (Runner.open(install, session_slots=2, max_parked_bytes=cap), quantized(install, bits, session_slots=2, max_parked_bytes=cap)):  # fmt: skip
        runner.set_prefix_reuse(True)
        serve_turn(runner, PROMPT)
        serve_turn(runner, [5, 6, 7])  # parks the first
        kept, _ = serve_turn(runner, [*PROMPT, 9])
        assert bool(kept) == (runner.kv_quantization is not None), runner.last_reuse


def test_steered_quantized_chunks_equal_steps(install: Path) -> None:
    width = Runner.open(install).arch.hidden_size
    vector = {1: 4 * np.random.default_rng(0).standard_normal(width).astype(np.float32)}
    steering = SteeringPolicy.from_directions(vector, 1.0, "add")
    steps = sequential(quantized(install, steering=steering), PROMPT)
    chunked = quantized(install, steering=steering)
    chunked.prefill_chunk(PROMPT[:11], 0)
    last = chunked.prefill_chunk(PROMPT[11:], 11)
    np.testing.assert_allclose(np.array(last), steps[-1], atol=ATOL)
    assert not np.allclose(steps, sequential(quantized(install), PROMPT), atol=ATOL)


# -- refusals -------------------------------------------------------------------


@pytest.fixture
def weightless(install: Path, tmp_path: Path) -> Path:
    """The install without its weight files: a refusal that reads no weight
    still comes first."""
    path = tmp_path / "weightless"
    shutil.copytree(install, path)
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    return path


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_bits": 3}, "--kv-bits 3: K/V quantize to 4 or 8 bits; pass --kv-bits 4 or"),
        ({"kv_bits": 4, "kv_group_size": 48}, "--kv-group-size 48: MLX quantizes in groups"),
        ({"kv_bits": 8, "kv_group_size": 128}, "pass a --kv-group-size (32, 64 or 128) that"),
    ],
)
def test_bad_values_are_refused_before_any_weight_is_read(
    weightless: Path, options: dict[str, int], message: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        Runner.open(weightless, **options)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_family_attending_over_its_own_kv_is_refused(qwen4_exp_install: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot read a quantized K/V cache; drop --kv-bits"):
        Runner.open(qwen4_exp_install, kv_bits=8)


def test_cli_refuses_a_group_size_without_bits(
    install: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["generate", str(install), "--prompt", "hi", "--kv-group-size", "32"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "add --kv-bits 4 or --kv-bits 8" in err and "\n" not in err


def test_layer_kv_quantizes_what_it_stores() -> None:
    """Each row is quantized on its own, so what the cache hands back is
    ``mx.quantize`` of what went in, however the rows were written."""
    rows = mx.random.normal((1, 2, 300, 64), key=mx.random.key(0))
    quant = KVQuantization(bits=4, group_size=64)
    layer = LayerKV(quant=quant)
    layer.update(rows[:, :, :7], rows[:, :, :7])
    for i in range(7, 300):  # past a block of 256: the buffers grow
        layer.update(rows[:, :, i : i + 1], rows[:, :, i : i + 1])
    keys, _, start = layer.update_and_fetch(rows[:, :, :0], rows[:, :, :0])
    want = mx.quantize(rows, group_size=64, bits=4)
    assert start == 0 and isinstance(keys, QuantizedRows)
    for got, expected in zip(keys.parts, want, strict=True):
        assert mx.array_equal(got, expected)


# -- the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(install: Path) -> Iterator[ThreadedServer]:
    worker = RunnerWorker()
    runner = worker.run(lambda: quantized(install, session_slots=3))
    app = create_app(runner, load_text(install), worker=worker)
    with ThreadedServer(app) as served:
        served.family = runner.family.name  # type: ignore[attr-defined]
        yield served


def test_the_server_serves_and_shows_the_setting(install: Path, server: ThreadedServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=f"kvq-{server.family}",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
    )
    assert reply.choices[0].message.content is not None
    body = httpx.get(f"{server.base_url}/turbospark/sessions").json()
    assert body["kv_cache"] == f"4-bit, group {GROUP}"
    (session,) = body["sessions"]
    assert 0 < session["bytes"] == body["pool"]["live_bytes"]
