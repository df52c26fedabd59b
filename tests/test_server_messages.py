"""Anthropic's Messages API over loopback with the real ``anthropic`` SDK: create
(streamed and not), ``messages.stream``, a forced tool call, a ``tool_result``
turn, ``count_tokens``, and refusals in Anthropic's error shape."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest
from serving import WEATHER_PARAMS as PARAMS
from serving import serving

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.text import load_text

MODEL = "tiny-messages"
TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": PARAMS}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    path = tmp_path_factory.mktemp("messages-qwen")
    build_synthetic_install("qwen_gdn", path, vocab_size=160, num_layers=2, model_id=MODEL)
    with serving(path, load_text(path), slots=2) as running:
        yield running


def api(server: ThreadedServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def test_create(server: ThreadedServer) -> None:
    reply = api(server).messages.create(
        model=MODEL, max_tokens=5, system="Be brief.", messages=ASK, extra_body={"temperature": 0.0}
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.content[0].type == "text"
    assert reply.stop_reason in {"end_turn", "max_tokens"}
    assert reply.usage.output_tokens <= 5 and reply.usage.input_tokens > 0
    again = api(server).messages.create(
        model=MODEL, max_tokens=5, system="Be brief.", messages=ASK, extra_body={"temperature": 0.0}
    )
    assert again.content[0].text == reply.content[0].text  # greedy: the same text


def test_create_streamed_matches(server: ThreadedServer) -> None:
    kwargs = dict(model=MODEL, max_tokens=6, messages=ASK, extra_body={"temperature": 0.0})
    whole = api(server).messages.create(**kwargs)
    events = list(api(server).messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and events[-2].delta.stop_reason == whole.stop_reason
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    with api(server).messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequence(server: ThreadedServer) -> None:
    free = api(server).messages.create(
        model=MODEL, max_tokens=12, messages=ASK, extra_body={"temperature": 0.0}
    )
    text = free.content[0].text
    stop = text[4:6] if len(text) >= 6 else None
    if not stop or not stop.strip():
        pytest.skip("the greedy reply is too short or blank to pick a stop sequence from")
    reply = api(server).messages.create(
        model=MODEL,
        max_tokens=12,
        messages=ASK,
        extra_body={"temperature": 0.0},
        stop_sequences=[stop],
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_use_validates(server: ThreadedServer, stream: bool) -> None:
    kwargs = dict(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS)
    if not stream:
        reply = api(server).messages.create(**kwargs, tool_choice={"type": "any"})
    else:
        choice = {"type": "tool", "name": "get_weather"}
        with api(server).messages.stream(**kwargs, tool_choice=choice) as events:
            reply = events.get_final_message()
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and uses[0].name == "get_weather"
    assert uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, PARAMS)


def test_a_tool_result_turn_is_accepted(server: ThreadedServer) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris", "days": 1},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}],
        },
    ]
    reply = api(server).messages.create(model=MODEL, max_tokens=4, messages=messages, tools=TOOLS)
    assert reply.stop_reason in {"end_turn", "max_tokens", "tool_use"}
    counted = api(server).messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_count_tokens(server: ThreadedServer) -> None:
    short = api(server).messages.count_tokens(model=MODEL, messages=ASK)
    longer = api(server).messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    assert 0 < short.input_tokens < longer.input_tokens


def test_missing_max_tokens_is_a_bad_request(server: ThreadedServer) -> None:
    reply = httpx.post(f"{server.base_url}/v1/messages", json={"model": MODEL, "messages": ASK})
    assert reply.status_code == 400
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        api(server).messages.create(model=MODEL, messages=ASK, max_tokens=None, timeout=30)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "image",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools"),
        ({"model": "nope"}, "nope"),
    ],
)
def test_refusals_name_the_field(
    server: ThreadedServer, fields: dict[str, object], named: str
) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, **fields}
    reply = httpx.post(f"{server.base_url}/v1/messages", json=body)
    assert reply.status_code in {400, 404}, reply.text
    assert reply.json()["type"] == "error" and named in reply.json()["error"]["message"]
