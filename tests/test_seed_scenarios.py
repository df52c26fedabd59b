"""Every scenario of the original runtime's test file (the "seed"; its rules are
written down in `docs/SEMANTICS.md`) on our API.

These are bookkeeping tests: which session's tokens end up where. They run on
the runner's real code paths (sequential `produce_prefill` and the server's
chunked `prefill_chunk`), on real synthetic installs.
"""

from __future__ import annotations

import pytest

from helpers import feed, feed_chunked, open_runner, text_positions
from turbospark import (
    DraftPolicies,
    ExpertCacheSlots,
    ReuseReason,
    Runner,
    SessionPoolUnsupported,
    SteeringPolicy,
    peek_manifest_arch,
)

SESSION_A = [100, 101, 5, 9, 2, 7, 1, 3, 8, 4, 6, 0, 11]
SESSION_B = [100, 101, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]
SESSION_A_CONTINUED = [*SESSION_A, 99, 98]


def test_an_active_image_prompt_cannot_select_a_parked_session(gemma4_install):
    runner = open_runner(gemma4_install, 2)
    victim, other = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
    runner.reset()
    feed(runner, victim)
    runner.reset()
    feed(runner, other)

    runner.set_prompt_vision([], text_positions(len(victim)), len(victim))
    assert runner.try_reuse_prefix(victim) == 0, (
        "an image request must not swap in token-matching state parked by another request"
    )
    assert not runner.last_reuse.swapped
    assert runner.last_reuse.reason == ReuseReason.TAINTED


def test_state_produced_with_an_image_map_remains_tainted_when_parked(gemma4_install):
    runner = open_runner(gemma4_install, 2)
    image_prompt, other = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]

    runner.set_prompt_vision([], text_positions(len(image_prompt)), len(image_prompt))
    runner.reset()
    feed(runner, image_prompt)
    runner.clear_prompt_vision()

    assert runner.try_reuse_prefix(other) == 0
    runner.reset()
    feed(runner, other)
    assert runner.try_reuse_prefix(image_prompt) == 0, (
        "state built while an image map was active must remain tainted after it is parked"
    )


def test_a_pool_of_one_is_a_complete_no_op(gemma4_install):
    runner = open_runner(gemma4_install, 1)
    runner.reset()
    feed(runner, SESSION_A)
    reused = runner.try_reuse_prefix(SESSION_B)
    assert reused == 2, "without a pool, a shallow match is reused in place unchanged"
    assert runner.last_reuse.reason == ReuseReason.REWOUND
    assert runner.session_pool_size == 1


def test_a_shallow_match_against_the_live_session_does_not_destroy_it(gemma4_install):
    runner = open_runner(gemma4_install, 2)
    runner.reset()
    feed(runner, SESSION_A)

    assert runner.try_reuse_prefix(SESSION_B) == 0, (
        "a shallow match (2 of 13) that would discard more than it keeps must be refused with a pool"
    )
    assert runner.last_reuse.reason == ReuseReason.SHALLOW_MATCH
    runner.reset()
    feed(runner, SESSION_B)

    reused = runner.try_reuse_prefix(SESSION_A_CONTINUED)
    assert reused >= 12, f"session A should have been parked, not destroyed; reused {reused}"
    assert runner.last_reuse.swapped


def test_a_shallow_match_does_not_destroy_a_chunked_prefill_session(gemma4_install):
    runner = open_runner(gemma4_install, 2)
    runner.reset()
    feed_chunked(runner, SESSION_A[:10], SESSION_A[10:])

    assert runner.try_reuse_prefix(SESSION_B) == 0, "refused on the chunked path too"
    runner.reset()
    feed_chunked(runner, SESSION_B, [61, 62])

    reused = runner.try_reuse_prefix(SESSION_A_CONTINUED)
    assert reused >= 12, f"A's chunked-prefill session should have been parked; reused {reused}"


def test_eviction_is_reported_only_when_something_real_was_discarded(gemma4_install):
    runner = open_runner(gemma4_install, 2)
    runner.reset()
    feed(runner, [1, 2, 3, 4, 5, 6])

    assert runner.try_reuse_prefix([7, 8, 9, 10, 11, 12]) == 0
    runner.reset()
    assert not runner.session_slot_evicted(), "promoting a never-used slot must not report"
    feed(runner, [7, 8, 9, 10, 11, 12])

    assert runner.try_reuse_prefix([13, 14, 15, 16, 17, 18]) == 0
    runner.reset()
    assert runner.session_slot_evicted(), "the LRU slot held session A's real content"


def test_a_shallow_match_does_not_destroy_a_gdn_familys_recurrent_state(qwen_gdn_install):
    arch = peek_manifest_arch(qwen_gdn_install)
    assert arch.family == "qwen_gdn"
    runner = open_runner(qwen_gdn_install, 2)
    runner.reset()
    feed(runner, SESSION_A)

    assert runner.try_reuse_prefix(SESSION_B) == 0, "a rewind is always refused on a GDN family"
    assert runner.last_reuse.reason == ReuseReason.NOT_REWINDABLE
    runner.reset()
    feed(runner, SESSION_B)

    reused = runner.try_reuse_prefix(SESSION_A_CONTINUED)
    assert reused >= 12, f"A's GDN-carrying session should have been parked; reused {reused}"
    assert runner.last_reuse.reason == ReuseReason.EXTENDS


def test_a_session_pool_is_refused_by_name_on_qwen4_exp(qwen4_exp_install):
    arch = peek_manifest_arch(qwen4_exp_install)
    policies = dict(
        expert_cache=ExpertCacheSlots.all(),
        draft=DraftPolicies.off(),
        steering=SteeringPolicy.off(),
    )
    Runner.open(qwen4_exp_install, arch, 4096, session_slots=1, **policies)

    with pytest.raises(SessionPoolUnsupported) as excinfo:
        Runner.open(qwen4_exp_install, arch, 4096, session_slots=2, **policies)
    text = str(excinfo.value)
    for needle in ("--session-slots", "gdn", "qsa", "ngram_context", "ple_conv_tail",
                   "plugins/qwen4_exp/turbospark_qwen4_exp/state.py"):  # fmt: skip
        assert needle in text, text
