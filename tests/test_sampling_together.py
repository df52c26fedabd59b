"""Batched sampling draws, row for row, what each row's own sampler draws."""

from __future__ import annotations

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark.generation.sampling import Sampler, SamplingParams, sample_together

VOCAB = 40

params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3, 10, VOCAB]),
    top_p=st.sampled_from([0.2, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(params, min_size=2, max_size=5), logits_seed=st.integers(0, 1000))
def test_sample_together_equals_each_sampler_alone(rows, logits_seed):
    together = [Sampler(p) for p in rows]
    alone = [Sampler(p) for p in rows]
    for step in range(3):  # keys advance identically step after step
        logits = mx.random.normal((len(rows), VOCAB), key=mx.random.key(logits_seed + step))
        batched = sample_together(together, logits).tolist()
        assert batched == [sampler(logits[i]).item() for i, sampler in enumerate(alone)]


def test_an_unseeded_sampler_takes_its_seed_from_the_host() -> None:
    """A request without a seed gets a fresh one without an MLX draw: reading one
    (``.item()``) would wait for every decode step queued before the request
    was admitted. MLX's global key is left as it was, and two samplers differ."""
    mx.random.seed(3)
    expected = mx.random.uniform().item()
    mx.random.seed(3)
    samplers = [Sampler(SamplingParams(temperature=1.0)) for _ in range(2)]
    assert mx.random.uniform().item() == expected
    draws = [s(mx.zeros((VOCAB,))).item() for s in samplers for _ in range(4)]
    assert draws[:4] != draws[4:]
