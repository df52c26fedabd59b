"""``/v1/embeddings`` with the real ``openai`` SDK: pooled final hidden states,
normalized, equal to the runner's own hidden states, and no session touched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mutant_families import MutantGemma4
from serving import client, serving

from turbospark.errors import InvalidInput
from turbospark.generation.runner import Runner
from turbospark.loading.plugins import FamilyRegistry, default_registry
from turbospark.server import ThreadedServer
from turbospark.text import TextCodec, load_text

MODEL = "tiny-embeddings"
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France, and a city."]


@pytest.fixture(scope="module")
def server(install: Path, codec: TextCodec) -> Iterator[ThreadedServer]:
    with serving(install, codec, slots=2) as running:
        yield running


def state_of(server: ThreadedServer) -> list[tuple[int, ...]]:
    """Every session's tokens and bytes, read on the runner thread."""
    service = server.service  # type: ignore[attr-defined]

    def read() -> list[object]:
        runner = service.runner
        return [runner.session_nbytes(), [s.position for s in runner.session_states()[0].values()]]

    return service.engine.call(read).result()


def expected(install: Path, codec: TextCodec, text: str) -> np.ndarray:
    """The other path: the whole text through the family's hidden-state hook at
    once, mean-pooled and normalized here."""
    runner = Runner.open(install, context_length=256)
    ids = codec.encode(text, add_special_tokens=True)
    state = runner._new_state()
    hook = runner._hook.turbospark_forward_hidden
    hidden = hook(model=runner.model, tokens=mx.array(ids), start=0, state=state)
    mean = np.array(hidden.astype(mx.float32)).mean(axis=0)
    return mean / np.linalg.norm(mean)


def test_embeddings_are_pooled_hidden_states_and_touch_no_session(
    server: ThreadedServer, install: Path, codec: TextCodec
) -> None:
    api = client(server)
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert chat.choices
    before = state_of(server)
    one = api.embeddings.create(model=MODEL, input=TEXTS[0])  # the SDK asks for base64
    many = api.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert state_of(server) == before  # no session, live or parked, changed
    assert [d.index for d in many.data] == [0, 1] and many.object == "list"
    assert np.allclose(one.data[0].embedding, many.data[0].embedding, atol=1e-6)
    for text, item in zip(TEXTS, many.data, strict=True):
        vector = np.array(item.embedding)
        assert abs(np.linalg.norm(vector) - 1) < 1e-5
        assert np.allclose(vector, expected(install, codec, text), atol=1e-4)
    assert not np.allclose(many.data[0].embedding, many.data[1].embedding)
    tokens = sum(len(codec.encode(t, add_special_tokens=True)) for t in TEXTS)
    assert many.usage.prompt_tokens == many.usage.total_tokens == tokens
    ids = codec.encode(TEXTS[1], add_special_tokens=True)
    by_ids = api.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, many.data[1].embedding, atol=1e-6)
    again = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    usage = again.usage.model_extra["turbospark"]
    assert usage["reuse_reason"] != "no_history"  # the conversation was still there


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["fine", ""]}, "input.1"),
        ({"input": [[1, 2], [100000]]}, "input.1"),
        ({"input": "x", "dimensions": 3}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ["x"] * 300}, "input"),
    ],
)
def test_bad_input_is_refused_naming_the_field(
    server: ThreadedServer, body: dict[str, object], param: str
) -> None:
    before = state_of(server)
    reply = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert state_of(server) == before


def test_a_family_without_hidden_states_is_refused_by_name(tmp_path: Path) -> None:
    """A family implementing no turbospark_forward_hidden (a wrapper of gemma4
    that forwards only the required hooks) is refused, by the runner and the server."""
    plugin = MutantGemma4("plain_gemma", None, default_registry().get("gemma4").plugin)
    registry = FamilyRegistry()
    registry.register(plugin, name="plain_gemma")
    try:
        registry.get("plain_gemma").manager().hook.turbospark_build_synthetic_install(
            path=tmp_path, dims={"num_layers": 2, "sliding_window": 8}
        )
        runner = Runner.open(tmp_path, context_length=64, registry=registry)
        assert not runner.embeds
        with pytest.raises(InvalidInput, match="plain_gemma family gives no hidden states"):
            runner.embed([1, 2, 3])
        with serving(tmp_path, load_text(tmp_path), slots=1, registry=registry) as running:
            reply = httpx.post(
                f"{running.base_url}/v1/embeddings",
                json={"model": runner.manifest.model_id, "input": "hello"},
            )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"
        assert "plain_gemma" in reply.json()["error"]["message"]
    finally:
        registry.unregister("plain_gemma")


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn", "qwen4_exp"])
def test_hidden_states_are_what_the_head_reads_and_chunking_changes_nothing(family, request):
    install = request.getfixturevalue(f"{family}_install")
    runner = Runner.open(install, context_length=64, session_slots=0)
    ids = [2, 5, 9, 14, 20, 31, 40, 41, 42, 43]
    whole, chunked = runner.embed(ids), runner.embed(ids, chunk_size=3)
    assert mx.allclose(whole, chunked, atol=1e-5).item()
    hidden = runner._hook.turbospark_forward_hidden(
        model=runner.model, tokens=mx.array(ids), start=0, state=runner._new_state()
    )
    logits = runner.prefill_chunk(ids, 0)  # the generation path, on the live session
    assert mx.allclose(runner.model.head(hidden[-1:])[0], logits, atol=1e-4).item()
