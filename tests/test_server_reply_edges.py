"""The edges of a reply, with the real SDKs: a token limit of zero is refused by
name on every route (and changes no session); an Anthropic stream whose text
decodes to "" still carries its one empty text block, as the non-streamed reply
does; a stream the client closes is counted as ``cancelled`` in ``/metrics``."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import client, serving, sessions

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.text import load_text

MODEL = "tiny-edges"
ASK = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    path = tmp_path_factory.mktemp("edges-qwen")
    build_synthetic_install("qwen_gdn", path, vocab_size=160, num_layers=2, model_id=MODEL)
    with serving(path, load_text(path), slots=2) as running:
        yield running


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("chat/completions", {"messages": ASK, "max_tokens": 0}, "max_tokens"),
        (
            "chat/completions",
            {"messages": ASK, "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ("completions", {"prompt": "Say", "max_tokens": 0}, "max_tokens"),
        ("messages", {"messages": ASK, "max_tokens": 0}, "max_tokens"),
        ("responses", {"input": "Say", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_a_limit_of_zero_tokens_is_refused_by_name(
    server: ThreadedServer, route: str, fields: dict, param: str
) -> None:
    client(server).chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    before = sessions(server)
    reply = httpx.post(f"{server.base_url}/v1/{route}", json={"model": MODEL, **fields}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert param in error["message"] and "greater than or equal to 1" in error["message"]
    if "param" in error:
        assert error["param"] == param
    assert sessions(server) == before


def test_the_openai_sdk_gets_the_refusal(server: ThreadedServer) -> None:
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client(server).chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(server).completions.create(model=MODEL, prompt="Say", max_tokens=0)


def test_an_empty_anthropic_stream_has_its_text_block(server: ThreadedServer) -> None:
    """A stop sequence that is the greedy reply's first token ends it with no text."""
    api = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    greedy = {"temperature": 0.0}
    first = api.messages.create(model=MODEL, max_tokens=1, messages=ASK, extra_body=greedy)
    token = first.content[0].text
    assert token.strip(), "the greedy first token must be text a stop sequence can name"
    kwargs = dict(
        model=MODEL, max_tokens=5, messages=ASK, stop_sequences=[token], extra_body=greedy
    )
    whole = api.messages.create(**kwargs)
    assert [(b.type, b.text) for b in whole.content] == [("text", "")]
    with api.messages.stream(**kwargs) as stream:
        assert stream.get_final_text() == ""
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", "")]
    assert final.stop_reason == whole.stop_reason == "stop_sequence"


def requests_total(server: ThreadedServer, outcome: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "turbospark_requests_total"
        and s.labels == {"endpoint": "chat.completions", "outcome": outcome}
    )


def test_a_stream_the_client_closes_counts_as_cancelled(server: ThreadedServer) -> None:
    ok, cancelled = requests_total(server, "ok"), requests_total(server, "cancelled")
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30
    ) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:"):
                break  # one event, then hang up
    deadline = time.monotonic() + 30  # a wait for the server to notice, not a measurement
    while requests_total(server, "cancelled") == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_total(server, "cancelled") == cancelled + 1
    assert requests_total(server, "ok") == ok
    list(
        client(server).chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, stream=True)
    )
    deadline = time.monotonic() + 30
    while requests_total(server, "ok") == ok and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_total(server, "ok") == ok + 1
