"""The prefix record's rules (SEMANTICS.md), against a plain reference."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from turbospark.sessions.prefix import PrefixRecord

ids = st.lists(st.integers(0, 3), max_size=200)


def reference_common_prefix(record: list[int], prompt: list[int]) -> int:
    n = 0
    limit = min(len(record), len(prompt) - 1)
    while n < limit and record[n] == prompt[n]:
        n += 1
    return max(n, 0)


@given(record=ids, prompt=ids)
def test_common_prefix_matches_the_definition(record, prompt):
    rec = PrefixRecord()
    rec.write(0, record)
    expected = reference_common_prefix(record, prompt) if record and prompt else 0
    assert rec.common_prefix(prompt) == expected


def test_writes_extend_truncate_and_gaps_taint():
    rec = PrefixRecord()
    rec.write(0, [1, 2, 3])
    rec.write(3, [4])
    assert rec.tokens == [1, 2, 3, 4]
    rec.write(2, [9])
    assert rec.tokens == [1, 2, 9] and not rec.tainted
    rec.write(5, [7])
    assert rec.tokens == [] and rec.tainted
    assert rec.common_prefix([1, 2, 9, 4]) == 0
    rec.clear()
    assert not rec.tainted


def test_at_least_one_prompt_token_is_left_to_feed():
    rec = PrefixRecord()
    rec.write(0, [1, 2, 3])
    assert rec.common_prefix([1, 2, 3]) == 2
    assert rec.common_prefix([1]) == 0
    assert rec.common_prefix([]) == 0
