"""Runner-level behaviour past the seed scenarios: exact resumes, checkpoints, every reason.

Logits equality between two paths (parked-and-resumed vs uninterrupted,
chunked vs sequential) is the main check: it fails on any cross-talk.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from helpers import feed, open_runner, serve_turn, text_positions
from turbospark import ReuseReason, Runner


def fresh_logits(path, history: list[int], chunks: list[int]) -> mx.array:
    """Logits after feeding *history* in chunks of the given sizes on a fresh runner."""
    runner = Runner.open(path)
    start = 0
    for size in chunks:
        logits = runner.prefill_chunk(history[start : start + size], start)
        start += size
    assert start == len(history)
    return logits


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_interleaved_conversations_resume_exactly(family, request):
    install = request.getfixturevalue(f"{family}_install")
    runner = open_runner(install, 3)
    conversations = {
        "a": [1, 3, 20, 21, 40, 41, 42, 43, 44, 45, 46],
        "b": [1, 3, 20, 21, 60, 61, 62, 63, 64, 65, 66],
        "c": [1, 3, 20, 21, 80, 81, 82, 83, 84, 85, 86],
    }
    sizes: dict[str, list[int]] = {name: [] for name in conversations}
    for turn in range(3):
        for name in conversations:
            extra = [30 + turn, 31 + turn, 32 + turn]
            prompt = conversations[name] + extra
            kept, logits = serve_turn(runner, prompt)
            if turn:
                assert kept == len(conversations[name]), runner.last_reuse
                assert runner.last_reuse.reason == ReuseReason.EXTENDS
            elif name != "a" and family == "gemma4":
                # b and c open like the parked a: they start from that shared opening.
                assert kept == 4 and runner.last_reuse.reason == ReuseReason.SHARED_PREFIX
                sizes[name].append(kept)
            elif name != "a":
                # a GDN state cannot be cut back to the opening (no checkpoint there)
                assert kept == 0, runner.last_reuse
            sizes[name].append(len(prompt) - kept)
            assert not runner.session_slot_evicted()
            conversations[name] = prompt
            expected = fresh_logits(install, prompt, sizes[name])
            assert mx.allclose(logits, expected, atol=1e-5), (
                f"{family} conversation {name} turn {turn}"
            )


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_sequential_path_equals_chunked_path(family, request):
    install = request.getfixturevalue(f"{family}_install")
    tokens = [5, 17, 3, 99, 42, 8, 1, 77, 23, 64, 12, 90, 33]
    sequential = feed(Runner.open(install), tokens)
    chunked = fresh_logits(install, tokens, [4, 1, 8])
    assert mx.allclose(sequential, chunked, atol=1e-4)


def test_gdn_prompt_equal_to_history_is_refused_with_a_reason(qwen_gdn_install):
    runner = open_runner(qwen_gdn_install, 1)
    history = [1, 3, 20, 21, 40, 41, 42]
    runner.prefill_chunk(history, 0)
    assert runner.try_reuse_prefix(history) == 0
    assert runner.last_reuse.reason == ReuseReason.NOT_REWINDABLE
    assert "gdn" in runner.last_reuse.detail


def test_gdn_checkpoint_serves_a_reply_that_retokenises_differently(qwen_gdn_install):
    """The next prompt carries the reply as the chat template re-tokenises it,
    not the ids generated: the prompt-boundary checkpoint still saves the prompt."""
    runner = open_runner(qwen_gdn_install, 2)
    prompt = [1, 3, 20, 21, 40, 41, 42, 43, 44]
    serve_turn(runner, prompt)
    generated = [50, 51, 52, 53]
    logits = None
    for i, token in enumerate(generated):
        logits = runner.produce(token, len(prompt) + i)
    mx.eval(logits)
    retokenised = [50, 55, 52, 53]  # the reply as the template re-tokenises it: differs at 1
    next_prompt = prompt + retokenised + [60, 61]
    kept, logits = serve_turn(runner, next_prompt)
    assert kept == len(prompt), runner.last_reuse
    assert runner.last_reuse.reason == ReuseReason.CHECKPOINT
    expected = fresh_logits(
        qwen_gdn_install, next_prompt, [len(prompt), len(next_prompt) - len(prompt)]
    )
    assert mx.allclose(logits, expected, atol=1e-5)


def test_gdn_checkpoint_travels_with_its_parked_session(qwen_gdn_install):
    runner = open_runner(qwen_gdn_install, 2)
    a = [1, 3, 20, 21, 40, 41, 42, 43, 44]
    b = [1, 3, 20, 21, 70, 71, 72, 73, 74]
    serve_turn(runner, a)
    runner.produce(50, len(a))
    serve_turn(runner, b)  # parks a together with its checkpoint
    kept, logits = serve_turn(runner, [*a, 51, 52])  # reply re-tokenised differently
    assert runner.last_reuse.swapped and kept == len(a), runner.last_reuse
    assert runner.last_reuse.reason == ReuseReason.CHECKPOINT
    assert mx.allclose(logits, fresh_logits(qwen_gdn_install, [*a, 51, 52], [len(a), 2]), atol=1e-5)


def test_attention_family_rewinds_an_exact_repeat_by_one(gemma4_install):
    runner = open_runner(gemma4_install, 1)
    history = [1, 3, 20, 21, 40, 41, 42]
    runner.prefill_chunk(history, 0)
    assert runner.try_reuse_prefix(history) == len(history) - 1
    assert runner.last_reuse.reason == ReuseReason.REWOUND


def test_window_rewind_past_headroom_is_refused_with_a_reason(tmp_path):
    from turbospark import build_synthetic_install

    build_synthetic_install(
        "gemma4", tmp_path, vocab_size=128, num_layers=2, sliding_window=4, seed=1
    )
    runner = open_runner(tmp_path, 1)
    history = [(7 * i) % 120 + 5 for i in range(300)]
    for start in range(0, 300, 100):  # three chunks: the ring trims old rows
        runner.prefill_chunk(history[start : start + 100], start)
    diverged = [*history[:100], 3, 3, 3]
    assert runner.try_reuse_prefix(diverged) == 0
    assert runner.last_reuse.reason == ReuseReason.BEYOND_WINDOW
    assert "window" in runner.last_reuse.detail
    assert runner.position == 300  # refused: nothing rewound


def test_reuse_is_off_by_default_and_says_so(gemma4_install):
    runner = Runner.open(gemma4_install)
    runner.prefill_chunk([1, 2, 3, 4], 0)
    assert runner.try_reuse_prefix([1, 2, 3, 4, 5]) == 0
    assert runner.last_reuse.reason == ReuseReason.DISABLED


def test_clearing_the_vision_map_reverts_to_plain_positions(gemma4_install):
    tokens = [5, 6, 7, 8, 9]
    plain = Runner.open(gemma4_install).prefill_chunk(tokens, 0)
    runner = Runner.open(gemma4_install)
    runner.set_prompt_vision([], text_positions(len(tokens)), len(tokens))
    runner.clear_prompt_vision()
    assert mx.array_equal(runner.prefill_chunk(tokens, 0), plain)


def test_session_memory_is_reported_per_slot(gemma4_install):
    runner = open_runner(gemma4_install, 3)
    assert runner.session_nbytes() == [0, 0, 0]
    serve_turn(runner, [1, 2, 3, 4, 5, 6])
    live, *parked = runner.session_nbytes()
    assert live > 0 and parked == [0, 0]
    serve_turn(runner, [9, 9, 9, 9, 9, 9])
    assert sorted(runner.session_nbytes()) == [0, live, live]


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_snapshot_restore_rolls_the_live_session_back(family, request):
    install = request.getfixturevalue(f"{family}_install")
    runner = open_runner(install, 1)
    prompt = [1, 3, 20, 21, 40, 41, 42]
    runner.prefill_chunk(prompt, 0)
    snap = runner.snapshot()
    runner.prefill_chunk([9, 9, 9], len(prompt))  # a speculative continuation, rejected
    runner.restore(snap)
    assert runner.position == len(prompt)
    assert runner.try_reuse_prefix([*prompt, 5]) == len(prompt)
    logits = runner.prefill_chunk([5], len(prompt))
    assert mx.allclose(logits, fresh_logits(install, [*prompt, 5], [len(prompt), 1]), atol=1e-5)


def test_qwen4_exp_reuse_follows_the_non_rewindable_rule(qwen4_exp_install):
    runner = open_runner(qwen4_exp_install, 1)
    history = [1, 3, 20, 21, 40, 41, 42, 43]
    serve_turn(runner, history)
    assert runner.try_reuse_prefix([*history, 7]) == len(history)
    assert runner.last_reuse.reason == ReuseReason.EXTENDS
    runner.prefill_chunk([7], len(history))

    assert runner.try_reuse_prefix([*history, 9, 9]) == len(history)  # back to the checkpoint
    assert runner.last_reuse.reason == ReuseReason.CHECKPOINT
    for name in ("gdn", "ngram_context", "ple_conv_tail"):
        assert name in runner.last_reuse.detail
    logits = runner.prefill_chunk([9, 9], len(history))
    expected = fresh_logits(qwen4_exp_install, [*history, 9, 9], [len(history), 2])
    assert mx.allclose(logits, expected, atol=1e-5)

    runner.reset()
    runner.prefill_chunk(history, 0)  # no checkpoint this time
    assert runner.try_reuse_prefix(history) == 0
    assert runner.last_reuse.reason == ReuseReason.NOT_REWINDABLE


def test_parked_memory_is_capped_by_evicting_the_least_recent(gemma4_install):
    conversations = [[1, 3, 20 + i, 21, 40, 41, 42, 43, 44, 45] for i in range(3)]
    probe = open_runner(gemma4_install, 1)
    serve_turn(probe, conversations[0])
    one_session = probe.session_nbytes()[0]

    runner = Runner.open(gemma4_install, session_slots=3, max_parked_bytes=one_session)
    runner.set_prefix_reuse(True)
    serve_turn(runner, conversations[0])
    serve_turn(runner, conversations[1])  # parks a: fits the budget
    assert not runner.session_slot_evicted()
    serve_turn(runner, conversations[2])  # parks b: a (least recent) must go
    assert runner.session_slot_evicted()
    assert sum(runner.session_nbytes()[1:]) <= one_session
    # b survived the trim and resumes exactly; a was cleared and starts over.
    kept, logits = serve_turn(runner, [*conversations[1], 7])
    assert kept == len(conversations[1]) and runner.last_reuse.swapped
    assert mx.allclose(
        logits, fresh_logits(gemma4_install, [*conversations[1], 7], [10, 1]), atol=1e-5
    )
    assert sum(runner.session_nbytes()[1:]) <= one_session
    kept, _ = serve_turn(runner, [*conversations[0], 7])
    assert kept < len(conversations[0])


def test_a_negative_memory_cap_is_refused(gemma4_install):
    from turbospark import InvalidInput

    with pytest.raises(InvalidInput, match="max_parked_bytes"):
        Runner.open(gemma4_install, session_slots=2, max_parked_bytes=-1)


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_a_stop_id_fed_speculatively_is_taken_back(family, request):
    """Decoding builds each forward from the still-lazy id; when that id is a
    stop, the step is undone: the session holds the reply but not the stop id
    (as a loop that never fed it), and the next turn extends it exactly."""
    from turbospark.generation.generate import GenerationConfig, generate
    from turbospark.text import load_text

    install = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    prompt = [1, 3, 20, 21, 40, 41, 42, 43]
    free = generate(
        open_runner(install, 1), codec, prompt, GenerationConfig(max_tokens=8, stop_token_ids=[])
    )
    stop_at = next(i for i, t in enumerate(free.tokens) if i >= 2 and t not in free.tokens[:i])
    runner = open_runner(install, 1)
    config = GenerationConfig(max_tokens=8, stop_token_ids=[free.tokens[stop_at]])
    done = generate(runner, codec, prompt, config)
    assert done.finish_reason == "stop" and done.tokens == free.tokens[:stop_at]
    assert runner.position == len(prompt) + stop_at  # every reply token, not the stop id
    follow = [*prompt, *done.tokens, 9]
    kept, logits = serve_turn(runner, follow)
    assert kept == len(prompt) + stop_at and runner.last_reuse.reason == ReuseReason.EXTENDS
    expected = fresh_logits(install, follow, [len(prompt), kept - len(prompt), len(follow) - kept])
    assert mx.allclose(logits, expected, atol=1e-4)


def test_take_back_refuses_when_there_is_nothing_to_undo(gemma4_install):
    from turbospark import InvalidInput

    runner = open_runner(gemma4_install, 1)
    runner.prefill_chunk([1, 2, 3], 0)
    with pytest.raises(InvalidInput, match="take_back"):
        runner.take_back()
    runner.produce(mx.array(4), 3)
    runner.produce(5, 4)  # the session moved on
    with pytest.raises(InvalidInput, match="take_back"):
        runner.take_back()
    assert runner.position == 5


def test_an_impossible_lazy_id_on_a_gdn_session_is_undone_not_lost(qwen_gdn_install):
    runner = open_runner(qwen_gdn_install, 1)
    prompt = [1, 3, 20, 21, 40, 41]
    runner.prefill_chunk(prompt, 0)
    from turbospark import InvalidInput

    with pytest.raises(InvalidInput, match="outside this model's vocabulary"):
        runner.produce(mx.array(10_000), len(prompt))
    assert runner.position == len(prompt), "the recurrent state came back from its undo references"
    logits = runner.prefill_chunk([7], len(prompt))
    assert mx.allclose(
        logits, fresh_logits(qwen_gdn_install, [*prompt, 7], [len(prompt), 1]), atol=1e-5
    )


def test_restore_brings_its_own_checkpoints_not_the_last_conversations(qwen_gdn_install):
    """Cross-talk through checkpoints: restoring B after A had taken a
    checkpoint must never resume B from A's recurrent state."""
    runner = open_runner(qwen_gdn_install, 1)
    b = [1, 3, *range(40, 78)]  # 40 tokens
    runner.prefill_chunk(b, 0)
    snap_b = runner.snapshot()
    runner.reset()
    a = [1, 3, 20, 21, 22, 23, 24, 25, 26, 27]
    runner.prefill_chunk(a, 0)
    runner.checkpoint()
    runner.prefill_chunk([5, 6, 7], len(a))
    runner.restore(snap_b)
    prompt = [*b[:12], 1, 2, 3]
    kept = runner.try_reuse_prefix(prompt)
    assert runner.last_reuse.reason != ReuseReason.CHECKPOINT, runner.last_reuse
    if kept == 0:
        runner.reset()
    logits = runner.prefill_chunk(prompt[kept:], kept)
    expected = fresh_logits(
        qwen_gdn_install, prompt, [kept, len(prompt) - kept] if kept else [len(prompt)]
    )
    assert mx.allclose(logits, expected, atol=1e-5)


def test_restore_keeps_the_snapshots_checkpoints(qwen_gdn_install):
    """A checkpoint taken before the snapshot still serves after a restore."""
    runner = open_runner(qwen_gdn_install, 1)
    runner.set_prefix_reuse(True)
    prompt = [1, 3, 20, 21, 22, 23]
    runner.prefill_chunk(prompt, 0)
    runner.checkpoint()
    runner.prefill_chunk([50, 51], len(prompt))
    snap = runner.snapshot()
    runner.reset()
    runner.prefill_chunk([1, 9, 9, 9], 0)
    runner.restore(snap)
    follow = [*prompt, 60, 61]
    assert runner.try_reuse_prefix(follow) == len(prompt), runner.last_reuse
    assert runner.last_reuse.reason == ReuseReason.CHECKPOINT
    logits = runner.prefill_chunk(follow[len(prompt) :], len(prompt))
    assert mx.allclose(logits, fresh_logits(qwen_gdn_install, follow, [len(follow)]), atol=1e-5)


@pytest.mark.parametrize("slots", [2, 4])
def test_a_shallow_match_on_a_parked_session_leaves_it_intact(gemma4_install, slots):
    """A new conversation matching a parked one's first 3 of 12 tokens
    takes that opening by reference; the parked conversation later resumes whole."""
    runner = open_runner(gemma4_install, slots)
    parked = [1, 3, 7, *range(40, 49)]  # 12 tokens
    serve_turn(runner, [*parked, 5])
    serve_turn(runner, [1, 3, 90, 91])  # a live conversation scoring 2: parks `parked`
    newcomer = [1, 3, 7, 100, 101, 102]
    kept, logits = serve_turn(runner, newcomer)
    report = runner.last_reuse
    assert (kept, report.reason, report.swapped) == (3, ReuseReason.SHARED_PREFIX, False), report
    assert report.evicted == runner.session_slot_evicted() == (slots == 2)
    assert mx.allclose(logits, fresh_logits(gemma4_install, newcomer, [3, 3]), atol=1e-5)
    back = [*parked, 5, 6]
    kept, logits = serve_turn(runner, back)
    if slots == 2:
        # One parked slot: parking the live conversation displaced it (reported above).
        assert kept == 3, runner.last_reuse
    else:
        assert kept == len(parked) + 1 and runner.last_reuse.swapped, runner.last_reuse
        expected = fresh_logits(gemma4_install, back, [len(parked) + 1, 1])
        assert mx.allclose(logits, expected, atol=1e-5)
