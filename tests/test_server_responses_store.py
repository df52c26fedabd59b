"""Stored responses over loopback with the real clients: ``openai``'s
``responses.create(previous_response_id=...)``, ``retrieve``, ``delete``,
``input_items`` and ``parse``; openai-agents' ``OpenAIResponsesModel`` with an
``output_type``; langchain's ``ChatOpenAI(use_responses_api=True)`` with
structured output. A continuation resumes the stored response's session and
answers as the whole conversation sent at once does (greedy), also when the
session was evicted and across a restart with ``--session-dir``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel
from serving import client, reference, serving, serving_with_disk, sessions

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.server.response_store import ResponseStore, ResponseStoreLimits, StoredResponse
from turbospark.text import TextCodec, load_text

MODEL = "tiny-store"
FIRST = "Plan a three day walk along the coast, please."
SECOND = "And where do we sleep on the second night?"
KNOBS: dict[str, Any] = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0}  # fmt: skip


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("store-gemma4")
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, sliding_window=8, model_id=MODEL
    )
    return path


@pytest.fixture(scope="module")
def codec(install: Path) -> TextCodec:
    return load_text(install)


@pytest.fixture(scope="module")
def server(install: Path, codec: TextCodec) -> Iterator[ThreadedServer]:
    with serving(install, codec, slots=3) as running:
        yield running


def reason(response: Any) -> str:
    return response.usage.model_extra["turbospark"]["reuse_reason"]


def whole(api: openai.OpenAI, first: Any) -> Any:
    """The reply to the conversation sent at once, stored nowhere, by a server
    that answered the first turn itself: only the server that generated a
    re-sent reply feeds it as its generated ids (SEMANTICS.md)."""
    api.responses.create(**KNOBS, input=FIRST, store=False)
    items = [{"role": "user", "content": FIRST}, *[o.model_dump() for o in first.output]]
    items.append({"role": "user", "content": SECOND})
    return api.responses.create(**KNOBS, input=items, store=False)


def test_a_continuation_resumes_the_session_and_equals_the_whole_conversation(
    server: ThreadedServer, install: Path, codec: TextCodec
) -> None:
    api = client(server)
    first = api.responses.create(**KNOBS, input=FIRST)
    second = api.responses.create(**KNOBS, input=SECOND, previous_response_id=first.id)
    assert reason(second) == "previous_response", second.usage
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.previous_response_id == first.id
    with reference(install, codec) as plain:
        expected = whole(client(plain), first)
    assert second.output_text == expected.output_text
    assert second.usage.input_tokens == expected.usage.input_tokens

    events = list(
        api.responses.create(**KNOBS, input="Thanks.", previous_response_id=second.id, stream=True)
    )
    done = events[-1].response
    assert reason(done) == "previous_response"
    assert api.responses.retrieve(done.id).output_text == done.output_text


def test_retrieve_input_items_and_delete(server: ThreadedServer) -> None:
    api = client(server)
    first = api.responses.create(**KNOBS, input=FIRST)
    second = api.responses.create(**KNOBS, input=SECOND, previous_response_id=first.id)
    assert api.responses.retrieve(first.id).output_text == first.output_text
    items = api.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")
    ]  # fmt: skip
    assert items[-1].content[0].text == SECOND
    newest = api.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].content[0].text == SECOND and newest.has_more

    api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        api.responses.retrieve(first.id)
    before = sessions(server)
    with pytest.raises(openai.NotFoundError, match=f"{first.id}.*deleted"):
        api.responses.create(**KNOBS, input=SECOND, previous_response_id=first.id)
    assert sessions(server) == before  # a refusal touches no session
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(first.id)


def test_store_false_stores_nothing(server: ThreadedServer) -> None:
    api = client(server)
    reply = api.responses.create(**KNOBS, input="Hi.", store=False)
    assert reply.store is False
    with pytest.raises(openai.NotFoundError, match="never stored"):
        api.responses.retrieve(reply.id)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ({"format": {"type": "json_schema", "name": "w"}}, "schema"),
        ({"format": {"type": "xml"}}, "text.format"),
    ],
)
def test_bad_input_is_refused_in_one_line(
    server: ThreadedServer, text: dict[str, Any], named: str
) -> None:
    before = sessions(server)
    reply = httpx.post(
        f"{server.base_url}/v1/responses", json={"model": MODEL, "input": "hi", "text": text}
    )
    assert reply.status_code == 400 and named in reply.json()["error"]["message"], reply.text
    reply = httpx.post(
        f"{server.base_url}/v1/responses",
        json={"model": MODEL, "input": "hi", "previous_response_id": "../etc"},
    )
    assert reply.status_code == 400 and "previous_response_id" in reply.text
    assert sessions(server) == before


def test_parse_and_json_object(server: ThreadedServer) -> None:
    api = client(server)
    parsed = api.responses.parse(
        model=MODEL, input="Weather?", text_format=Weather, max_output_tokens=40
    )
    assert isinstance(parsed.output_parsed, Weather)
    loose = api.responses.create(
        model=MODEL, input="Any JSON.", text={"format": {"type": "json_object"}},
        max_output_tokens=40,
    )  # fmt: skip
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)
    assert loose.text.format.type == "json_object"


@pytest.mark.slow  # importing openai-agents and langchain alone takes seconds
def test_structured_output_through_the_agent_frameworks(server: ThreadedServer) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    agent = Agent(
        name="weather",
        instructions="Answer.",
        model=OpenAIResponsesModel(MODEL, openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        )),
        output_type=Weather,
        model_settings=ModelSettings(max_tokens=40),
    )  # fmt: skip
    assert isinstance(asyncio.run(Runner.run(agent, "Weather?")).final_output, Weather)

    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused",
        use_responses_api=True, max_tokens=40, max_retries=0,
    )  # fmt: skip
    assert isinstance(llm.with_structured_output(Weather).invoke("Weather?"), Weather)


@pytest.mark.slow  # three servers and a pool pushed around: ~6 s
def test_an_evicted_session_is_prefilled_from_the_stored_items(
    install: Path, codec: TextCodec
) -> None:
    with serving(install, codec, slots=2) as running:
        api = client(running)
        first = api.responses.create(**KNOBS, input=FIRST)
        for other in ("Which tea goes with lemon cake?", "Name a river in France."):
            api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": other}], max_tokens=4
            )
        second = api.responses.create(**KNOBS, input=SECOND, previous_response_id=first.id)
        assert reason(second) == "previous_response_evicted", second.usage
    with reference(install, codec) as plain:
        assert second.output_text == whole(client(plain), first).output_text

    bounded = ResponseStoreLimits(max_count=2)
    with serving(install, codec, slots=2, response_store=bounded) as running:
        api = client(running)
        gone = api.responses.create(**KNOBS, input=FIRST)
        for text in ("One.", "Two."):
            api.responses.create(**KNOBS, input=text)
        with pytest.raises(openai.NotFoundError, match=f"{gone.id}.*at most 2 responses"):
            api.responses.create(**KNOBS, input=SECOND, previous_response_id=gone.id)
        scraped = httpx.get(f"{running.base_url}/metrics").text
        assert "turbospark_stored_response_evictions_total 1.0" in scraped
        assert "turbospark_stored_responses 2.0" in scraped


@pytest.mark.slow  # a server stopped and started again on its directory: ~4 s
def test_a_stored_response_survives_a_restart(
    install: Path, codec: TextCodec, tmp_path: Path
) -> None:
    with serving_with_disk(install, codec, tmp_path, slots=2) as running:
        first = client(running).responses.create(**KNOBS, input=FIRST)
    assert (tmp_path / "responses" / f"{first.id}.json").is_file()
    with serving_with_disk(install, codec, tmp_path, slots=2) as running:
        second = client(running).responses.create(
            **KNOBS, input=SECOND, previous_response_id=first.id
        )
    assert reason(second) == "previous_response", second.usage
    assert "restored_from_disk" in second.usage.model_extra["turbospark"]["reuse_detail"]
    with reference(install, codec) as plain:
        assert second.output_text == whole(client(plain), first).output_text


def entry(ident: str, age: float = 0.0, size: int = 1) -> StoredResponse:
    return StoredResponse(
        id=ident, created_at=time.time() - age, response={"id": ident, "output": []},
        context=[{"type": "message", "role": "user", "content": "x" * size}], tokens=[1, 2],
    )  # fmt: skip


def test_the_store_bounds_count_bytes_and_age_and_says_why(tmp_path: Path) -> None:
    store = ResponseStore(ResponseStoreLimits(max_count=2, max_bytes=2000, max_age=60), tmp_path)
    store.put(entry("resp_old", age=120))
    assert store.get("resp_old") is None and "--response-ttl" in store.why_gone("resp_old")
    for ident in ("resp_a", "resp_b", "resp_c"):
        store.put(entry(ident))
    assert store.get("resp_a") is None and "--max-stored-responses" in store.why_gone("resp_a")
    store.put(entry("resp_big", size=1800))
    assert store.get("resp_big") is not None and len(store) == 1
    assert "--response-store-memory" in store.why_gone("resp_c")
    assert store.evictions == 4 and store.nbytes <= 2000
    (tmp_path / "resp_bad.json").write_text("{not json")
    again = ResponseStore(store.limits, tmp_path)  # a restart: files indexed, a bad one ignored
    assert again.get("resp_big") is not None and again.get("resp_bad") is None


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-stored-responses", "-1"], "--max-stored-responses"),
        (["--response-ttl", "0"], "--response-ttl"),
        (["--response-store-memory", "0"], "--response-store-memory"),
    ],
)
def test_serve_refuses_bad_store_flags_in_one_line(
    install: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    from turbospark.cli import main

    assert main(["serve", str(install), *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert named in error and "\n" not in error
