"""``repetition_penalty`` (HF/vLLM): the per-row processor against a NumPy
reference, and the option through the real SDK on both endpoints."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from serving import client, serving, sessions

from turbospark import build_synthetic_install
from turbospark.errors import InvalidInput
from turbospark.generation.logits_processors import RepetitionPenalty
from turbospark.server import ThreadedServer
from turbospark.text import TextCodec, load_text

MODEL = "tiny-repetition"


def reference(logits: np.ndarray, seen: list[int], penalty: float) -> np.ndarray:
    """HF's RepetitionPenaltyLogitsProcessor, in NumPy."""
    out = logits.copy()
    ids = np.unique(np.asarray(seen, np.int64))
    picked = out[ids]
    out[ids] = np.where(picked < 0, picked * penalty, picked / penalty)
    return out


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_the_numpy_reference(penalty: float) -> None:
    rng = np.random.default_rng(0)
    vocab = 50
    prompt = [3, 7, 7, 11, 49]
    processor = RepetitionPenalty(penalty, prompt)
    seen = list(prompt)
    for token in [None, 20, 3, 0, 20]:
        if token is not None:
            processor.accept(mx.array(token))
            seen.append(token)
        logits = rng.normal(0, 3, vocab).astype(np.float32)
        got = np.array(processor(mx.array(logits)))
        np.testing.assert_allclose(got, reference(logits, seen, penalty), rtol=1e-6)


@pytest.mark.parametrize("penalty", [0.0, -1.0, 5e-324, 0.005, 100.5])
def test_repetition_penalty_out_of_range_is_refused(penalty: float) -> None:
    """Past 0.01–100 a seen logit leaves float32's range (5e-324 divides by
    zero): refused by name, not a reply of infinities."""
    with pytest.raises(InvalidInput, match=r"repetition_penalty must be between 0\.01 and 100"):
        RepetitionPenalty(penalty, [1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    path: Path = tmp_path_factory.mktemp("repetition-gemma4")
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, sliding_window=8, model_id=MODEL
    )
    codec: TextCodec = load_text(path)
    with serving(path, codec, slots=2) as running:
        yield running


def test_repetition_penalty_on_both_endpoints(server: ThreadedServer) -> None:
    sdk = client(server)
    messages = [{"role": "user", "content": "Repeat repeat repeat."}]
    greedy = {"max_tokens": 12, "temperature": 0.0}
    plain = sdk.chat.completions.create(model=MODEL, messages=messages, **greedy)
    strong = {"repetition_penalty": 50.0}
    penalized = sdk.chat.completions.create(
        model=MODEL, messages=messages, extra_body=strong, **greedy
    )
    assert penalized.choices[0].message.content is not None
    one = sdk.chat.completions.create(
        model=MODEL, messages=messages, extra_body={"repetition_penalty": 1.0}, **greedy
    )
    assert one.choices[0].message.content == plain.choices[0].message.content
    legacy = sdk.completions.create(
        model=MODEL, prompt="again again", extra_body={"repetition_penalty": None}, **greedy
    )
    assert legacy.choices[0].finish_reason in ("stop", "length")
    legacy = sdk.completions.create(model=MODEL, prompt="again again", extra_body=strong, **greedy)
    assert legacy.usage is not None and legacy.usage.completion_tokens > 0


@pytest.mark.parametrize("value", [0, -1.5, "x", 5e-324, 0.001, 101])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_repetition_penalty_is_a_400(server: ThreadedServer, path: str, value: object) -> None:
    body: dict[str, object] = {"model": MODEL, "repetition_penalty": value, "max_tokens": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    before = sessions(server)
    reply = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "repetition_penalty"
    assert sessions(server) == before
