"""OpenAI options agents send: nulls, n, batch prompts, logprobs, penalties, logit_bias,
structured output. Over loopback with the real ``openai`` SDK (and langchain's)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import mlx.core as mx
import openai
import pytest
from serving import client, serving

from turbospark import build_synthetic_install
from turbospark.generation.logits_processors import Penalties
from turbospark.server import ThreadedServer
from turbospark.text import TextCodec, load_text

MODEL = "tiny-options"
HI = [{"role": "user", "content": "Say something."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["ok", "count", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, TextCodec]]:
    path = tmp_path_factory.mktemp("options-gemma4")
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, sliding_window=8, model_id=MODEL
    )
    return path, load_text(path)


@pytest.fixture(scope="module")
def server(codec: tuple[Path, TextCodec]) -> Iterator[ThreadedServer]:
    with serving(codec[0], codec[1], slots=4) as running:
        yield running


def post(server: ThreadedServer, path: str, **body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=60)


def test_explicit_nulls_mean_the_defaults(server: ThreadedServer) -> None:
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None}
    reply = post(server, "/v1/chat/completions", messages=HI, max_tokens=3, **nulls)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 1
    legacy = post(server, "/v1/completions", prompt="hi", max_tokens=None, **nulls)
    assert legacy.status_code == 200, legacy.text
    assert legacy.json()["usage"]["completion_tokens"] <= 16  # the legacy default


def test_n_choices_are_independent_rows(server: ThreadedServer) -> None:
    api = client(server)
    greedy = api.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0)
    many = api.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert {c.message.content for c in many.choices} == {greedy.choices[0].message.content}
    assert many.usage.prompt_tokens == greedy.usage.prompt_tokens  # the prompt counts once
    assert many.usage.completion_tokens == 3 * greedy.usage.completion_tokens
    usage = many.usage.model_extra["turbospark"]
    cached = many.usage.prompt_tokens_details.cached_tokens
    assert usage["prefilled_tokens"] == many.usage.prompt_tokens - cached  # prefilled once

    sampled = api.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, temperature=1.5, n=2, seed=5
    )
    again = api.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, temperature=1.5, n=2, seed=5
    )
    texts = [c.message.content for c in sampled.choices]
    assert texts == [c.message.content for c in again.choices]  # seeded: reproducible
    assert texts[0] != texts[1]  # ...but not one sample twice
    for j, text in enumerate(texts):  # choice j is the single request with seed 5 + j
        alone = api.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=12, temperature=1.5, seed=5 + j
        )
        assert alone.choices[0].message.content == text

    stream = api.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=6, temperature=0, n=2, stream=True
    )
    parts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for event in stream:
        for choice in event.choices:
            parts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert parts == {0: greedy.choices[0].message.content, 1: greedy.choices[0].message.content}

    too_many = post(server, "/v1/chat/completions", messages=HI, n=100)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


def test_a_legacy_batch_prompt_gets_choices_per_prompt(server: ThreadedServer) -> None:
    api = client(server)
    alone = [
        api.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
        for p in ("one", "two")
    ]
    batch = api.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=5, temperature=0)
    assert [c.text for c in batch.choices] == alone
    echoed = api.completions.create(
        model=MODEL, prompt=["one", "two"], max_tokens=5, temperature=0, n=2, echo=True
    )
    assert [c.text for c in echoed.choices] == [
        "one" + alone[0],
        "one" + alone[0],
        "two" + alone[1],
        "two" + alone[1],
    ]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                        ],
                    }
                ]
            },
            "messages.0.content",
            "image_url",
        ),
        ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix", "fill-in-the-middle"),
        ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, None, "logprobs"),
        ("/v1/chat/completions", {"messages": HI, "functions": [{"name": "f"}]}, "functions", ""),
        ("/v1/chat/completions", {"messages": HI, "logit_bias": {"9999": 5}}, "logit_bias", ""),
        ("/v1/completions", {"prompt": "a", "best_of": 3}, None, "best_of"),
        (
            "/v1/chat/completions",
            {
                "messages": HI,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wat"}},
                },
            },
            "response_format",
            "wat",
        ),
    ],
)
def test_unsupported_options_are_one_line_refusals(
    server: ThreadedServer, path: str, body: dict[str, object], param: str | None, words: str
) -> None:
    reply = post(server, path, **body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert words in error["message"] and "\n" not in error["message"]
    assert post(server, path, **{**body, **_fixed(body)}).status_code == 200


def _fixed(body: dict[str, object]) -> dict[str, object]:
    """The same request without its bad part: the server still serves it."""
    if "messages" in body:
        return {"messages": HI, "max_tokens": 2} | {k: None for k in body if k not in {"messages"}}
    return {"prompt": "a", "max_tokens": 2, "suffix": None, "best_of": None}


def test_models_by_id(server: ThreadedServer) -> None:
    assert client(server).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-4")


def test_logprobs_chat_and_legacy(server: ThreadedServer, codec: tuple[Path, TextCodec]) -> None:
    api = client(server)
    reply = api.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: the top
        assert token.logprob <= 0

    stream = api.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, temperature=0, logprobs=True, stream=True
    )
    streamed = [t for e in stream for c in e.choices if c.logprobs for t in c.logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content])

    legacy = api.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=2
    )
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_logit_bias_and_penalties_steer_the_sample(
    server: ThreadedServer, codec: tuple[Path, TextCodec]
) -> None:
    api = client(server)
    x = codec[1].encode("x")
    assert len(x) == 1
    forced = api.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=6,
        temperature=0,
        logit_bias={str(x[0]): 100},
        stop=None,
    )
    assert forced.choices[0].message.content == "x" * 6
    # The same bias with a frequency penalty larger than it wins only once per... never:
    # a penalty of 2 per use cannot beat +100, so check the penalty on its own instead.
    plain = api.chat.completions.create(model=MODEL, messages=HI, max_tokens=24, temperature=0)
    penalized = api.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=24, temperature=0, frequency_penalty=2.0
    )
    ids = codec[1].encode(penalized.choices[0].message.content)
    plain_ids = codec[1].encode(plain.choices[0].message.content)
    assert max(ids.count(t) for t in set(ids)) <= max(plain_ids.count(t) for t in set(plain_ids))
    assert penalized.choices[0].message.content != plain.choices[0].message.content


def test_penalties_count_only_generated_tokens() -> None:
    penalties = Penalties(presence=0.5, frequency=1.0)
    logits = mx.zeros((8,))
    penalties(logits)  # the first call (after the prompt) has nothing to count
    penalties.accept(mx.array(3))
    penalties.accept(mx.array(3))
    out = penalties(logits).tolist()
    assert out[3] == pytest.approx(-2.5) and out[2] == 0.0


def test_response_format_json_schema_per_row(server: ThreadedServer) -> None:
    api = client(server)
    outcome: dict[str, object] = {}

    def plain() -> None:
        outcome["plain"] = api.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=40, temperature=1.0, seed=1
        )

    beside = threading.Thread(target=plain)
    beside.start()
    reply = api.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=80,
        temperature=1.0,
        n=2,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        },
    )
    beside.join()
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert outcome["plain"].choices[0].message.content  # type: ignore[attr-defined]

    streamed = api.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=80,
        seed=3,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    text = "".join(c.delta.content or "" for e in streamed for c in e.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_mode(server: ThreadedServer, codec: tuple[Path, TextCodec]) -> None:
    close = codec[1].encode("}")[0]
    reply = client(server).chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=200,
        seed=2,
        logit_bias={str(close): 8},  # a random model closes the object sooner
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_logprobs_of_ids_a_grammar_rules_out_are_the_floor(server: ThreadedServer) -> None:
    """An id a grammar's mask rules out has no finite log-probability; it is
    reported as vLLM reports it, -9999.0, where -inf made the whole reply a
    500 (JSON has no -inf). The OpenAI SDK reads the reply."""
    from turbospark.generation.sampling import LOGPROB_FLOOR

    reply = client(server).chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=4,
        seed=1,
        logprobs=True,
        top_logprobs=20,
        response_format={"type": "json_object"},
    )
    content = reply.choices[0].logprobs.content
    tops = [top.logprob for token in content for top in token.top_logprobs]
    assert min(tops) == LOGPROB_FLOOR
    assert all(token.logprob > LOGPROB_FLOOR for token in content)  # the chosen ids were allowed


def test_langchain_with_structured_output(server: ThreadedServer) -> None:
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        ok: bool
        count: int = Field(ge=0, le=99)
        tag: Literal["red", "green"]

    chat = ChatOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL, max_tokens=80, seed=4
    )
    answer = chat.with_structured_output(Answer, method="json_schema").invoke("Answer.")
    assert isinstance(answer, Answer)
