"""The generation loop: reuse contract, chunked prefill, sampling, stops, limits, early exit,
and the ``generate`` / ``chat`` commands built on it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import mlx.core as mx
import pytest

from turbospark import build_synthetic_install
from turbospark.cli import main
from turbospark.errors import ContextOverflow, InvalidInput
from turbospark.generation.generate import GenerationConfig, check_prompt, generate, stream_generate
from turbospark.generation.runner import Runner
from turbospark.generation.sampling import Sampler, SamplingParams, apply_top_k, apply_top_p
from turbospark.text import TextCodec, load_text

CONTEXT = 256


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gen-gemma4")
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, sliding_window=8, model_id="tiny-gen"
    )
    return path


@pytest.fixture(scope="module")
def codec(install: Path) -> TextCodec:
    return load_text(install)


def open_runner(install: Path, slots: int = 1) -> Runner:
    runner = Runner.open(install, context_length=CONTEXT, session_slots=slots)
    runner.set_prefix_reuse(True)
    return runner


def chat(codec: TextCodec, *turns: str) -> list[int]:
    roles = ["user", "assistant"]
    return codec.encode_chat([{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)])


def reference_greedy(install: Path, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding by hand on a fresh runner: prompt in one chunk, then produce."""
    runner = Runner.open(install, context_length=CONTEXT)
    logits = runner.prefill_chunk(prompt, 0)
    out = []
    for i in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = runner.produce(out[-1], len(prompt) + i)
    return out


def test_greedy_equals_a_hand_written_argmax_loop_for_any_chunk_size(
    install: Path, codec: TextCodec
) -> None:
    prompt = chat(codec, "Tell me a story about a dragon and a knight.")
    expected = reference_greedy(install, prompt, 12)
    for chunk_size in (512, 7):
        config = GenerationConfig(max_tokens=12, chunk_size=chunk_size, stop_token_ids=[])
        done = generate(open_runner(install), codec, prompt, config)
        assert done.tokens == expected
        assert done.finish_reason == "length"
        assert done.stats.prompt_tokens == len(prompt) and done.stats.generated_tokens == 12


def test_a_continued_conversation_reuses_its_prefix_and_decodes_the_same(
    install: Path, codec: TextCodec
) -> None:
    runner = open_runner(install)
    config = GenerationConfig(max_tokens=6, stop_token_ids=[])
    first = chat(codec, "What is the capital of France?")
    reply = generate(runner, codec, first, config)
    second = chat(codec, "What is the capital of France?", reply.text, "And of Spain?")
    done = generate(runner, codec, second, config)
    assert done.stats.reused_tokens >= len(first)
    assert done.stats.reuse_reason in {"extends", "rewound"}
    assert done.tokens == reference_greedy(install, second, 6)


def test_a_stream_abandoned_mid_way_leaves_a_reusable_session(
    install: Path, codec: TextCodec
) -> None:
    runner = open_runner(install)
    prompt = chat(codec, "Count slowly from one to one hundred.")
    stream = stream_generate(runner, codec, prompt, GenerationConfig(max_tokens=50))
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()  # the consumer went away after three tokens
    # Each yielded token had already been fed (its successor was computing meanwhile).
    assert runner.position == len(prompt) + 3
    done = generate(runner, codec, prompt, GenerationConfig(max_tokens=5, stop_token_ids=[]))
    assert done.stats.reused_tokens == len(prompt) - 1  # SEMANTICS' cap: one token left to feed
    assert done.tokens == reference_greedy(install, prompt, 5)


def test_seeded_sampling_is_reproducible(install: Path, codec: TextCodec) -> None:
    prompt = chat(codec, "Pick some random letters.")

    def sample(seed: int) -> list[int]:
        config = GenerationConfig(
            max_tokens=16, temperature=1.5, top_k=40, top_p=0.95, seed=seed, stop_token_ids=[]
        )
        return generate(open_runner(install), codec, prompt, config).tokens

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_strings_and_stop_ids_end_the_completion(install: Path, codec: TextCodec) -> None:
    prompt = chat(codec, "Say anything.")
    base = GenerationConfig(max_tokens=24, temperature=1.0, seed=3, stop_token_ids=[])
    free = generate(open_runner(install), codec, prompt, base)
    assert free.finish_reason == "length" and len(free.tokens) == 24
    stop = next(
        free.text[i : i + 2] for i in range(6, len(free.text) - 2) if free.text[i : i + 2].strip()
    )
    cut = generate(open_runner(install), codec, prompt, base.model_copy(update={"stop": [stop]}))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]

    stop_id = free.tokens[5]
    first = free.tokens.index(stop_id)
    by_id = generate(
        open_runner(install), codec, prompt, base.model_copy(update={"stop_token_ids": [stop_id]})
    )
    assert by_id.finish_reason == "stop" and by_id.tokens == free.tokens[:first]


def test_max_tokens_zero_and_the_context_end(install: Path, codec: TextCodec) -> None:
    prompt = chat(codec, "Hello")
    none = generate(open_runner(install), codec, prompt, GenerationConfig(max_tokens=0))
    assert none.tokens == [] and none.finish_reason == "length"
    runner = Runner.open(install, context_length=len(prompt) + 3)
    done = generate(runner, codec, prompt, GenerationConfig(stop_token_ids=[]))
    # Three more positions fit, and the fourth token is sampled but never fed.
    assert len(done.tokens) == 4 and done.finish_reason == "length"


def test_bad_prompts_are_refused_before_any_session_changes(
    install: Path, codec: TextCodec
) -> None:
    runner = open_runner(install, slots=2)
    prompt = chat(codec, "Keep this conversation warm.")
    generate(runner, codec, prompt, GenerationConfig(max_tokens=4))
    position = runner.position
    for bad, error in (
        ([], InvalidInput),
        ([1, 999], InvalidInput),
        ([5] * (CONTEXT + 1), ContextOverflow),
    ):
        with pytest.raises(error):
            generate(runner, codec, bad)
        with pytest.raises(error):
            check_prompt(runner, bad)
    assert runner.position == position
    again = generate(runner, codec, prompt, GenerationConfig(max_tokens=4))
    assert again.stats.reused_tokens == len(prompt) - 1 and not again.stats.evicted


def test_pool_stats_report_swaps_and_evictions(install: Path, codec: TextCodec) -> None:
    runner = open_runner(install, slots=2)
    config = GenerationConfig(max_tokens=3)
    conversations = [
        chat(codec, f"{name} opens a long enough conversation here.") for name in "ABC"
    ]
    stats = [generate(runner, codec, p, config).stats for p in conversations]
    assert [s.evicted for s in stats] == [False, False, True]  # C's reset evicted A
    # B's opening matches parked A only shallowly: A is parked, B starts from the shared part.
    assert stats[1].reuse_reason == "shared_prefix" and stats[1].reused_tokens > 0
    back = generate(runner, codec, conversations[1], config).stats
    assert back.swapped and back.reused_tokens == len(conversations[1]) - 1


def test_samplers_mask_what_they_should() -> None:
    logits = mx.array([0.0, 3.0, 1.0, 2.0, -1.0])
    assert mx.isinf(apply_top_k(logits, 2)).tolist() == [True, False, True, False, True]
    # softmax mass: 0.64, 0.24, 0.09, ... -> p=0.7 keeps the top two, p=0.5 only the first.
    assert mx.isinf(apply_top_p(logits, 0.7)).tolist() == [True, False, True, False, True]
    assert mx.isinf(apply_top_p(logits, 0.5)).tolist() == [True, False, True, True, True]
    assert int(Sampler(SamplingParams())(logits).item()) == 1
    draws = {
        int(Sampler(SamplingParams(temperature=1.0, top_k=1, seed=s))(logits).item())
        for s in range(5)
    }
    assert draws == {1}


def test_generate_command_json(install: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(install), "--prompt", "Hi", "--max-tokens", "3", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["tokens"]) <= 3 and record["stats"]["reuse_reason"] == "disabled"


def test_chat_command_with_piped_stdin_shows_reuse_per_turn(
    install: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = "Hello there, a first question.\nA follow-up question.\n/switch other\nUnrelated.\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    args = ["chat", str(install), "--session-slots", "2", "--max-tokens", "3"]
    assert main(args) == 0
    status = [line for line in capsys.readouterr().err.splitlines() if "prompt tokens" in line]
    assert len(status) == 3
    assert "reused 0/" in status[0] and "reused 0/" not in status[1]
    assert status[2].startswith("[other] reused 7/") and "shared_prefix" in status[2]


def test_a_lazy_sampled_token_is_checked_once_read(install: Path) -> None:
    """``produce`` takes a sampler's lazy id; an impossible one is refused after
    the fact and the session is put back where it was, its record tainted."""
    runner = open_runner(install, slots=1)
    runner.prefill_chunk([1, 3, 20, 21], 0)
    logits = runner.produce(mx.array(7), 4)
    assert runner.position == 5 and logits.shape == (runner.vocab_size,)
    with pytest.raises(InvalidInput, match="outside this model's vocabulary"):
        runner.produce(mx.array(10_000), 5)
    assert runner.position == 5
    assert runner.try_reuse_prefix([1, 3, 20, 21, 7, 8]) == 0
    assert runner.last_reuse.reason == "tainted"


def test_a_prompt_is_fed_in_whole_chunks_its_last_token_in_the_last(
    gemma4_install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-request loop feeds a prompt in chunks of ``chunk_size``, the last
    chunk with the logits of its last token: an 8-token prompt in chunks of 4
    is two forwards, not three (no forward of the last token alone)."""
    runner = Runner.open(gemma4_install, context_length=64)
    real = runner.feed
    fed: list[tuple[int, bool]] = []

    def spy(session, tokens, start, logits=False, then=None):
        if start < 8:  # the prompt's forwards, not the decode steps
            fed.append((len(tokens), logits))
        return real(session, tokens, start, logits=logits, then=then)

    monkeypatch.setattr(runner, "feed", spy)
    config = GenerationConfig(max_tokens=2, temperature=0.0, stop_token_ids=[], chunk_size=4)
    generate(runner, load_text(gemma4_install), [2, 5, 9, 14, 20, 31, 40, 41], config)
    assert fed == [(4, False), (4, True)]
