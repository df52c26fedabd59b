"""OpenAI's Responses API over loopback with the real ``openai`` SDK:
``client.responses.create`` streamed and not, function tools, refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from serving import client, serving

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.text import load_text

MODEL = "tiny-responses"
PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    path = tmp_path_factory.mktemp("responses-qwen")
    build_synthetic_install("qwen_gdn", path, vocab_size=160, num_layers=2, model_id=MODEL)
    with serving(path, load_text(path), slots=2) as running:
        yield running


def test_create_streamed_and_not(server: ThreadedServer) -> None:
    kwargs = dict(
        model=MODEL, input="Say hi.", instructions="Be brief.", max_output_tokens=6,
        temperature=0.0, reasoning={"effort": "none"},  # the answer alone: no reasoning item
    )  # fmt: skip
    whole = client(server).responses.create(**kwargs)
    assert whole.object == "response" and whole.output[0].type == "message"
    assert whole.status in {"completed", "incomplete"}
    assert whole.usage.output_tokens <= 6 and whole.usage.input_tokens > 0
    events = list(client(server).responses.create(**kwargs, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in {"response.completed", "response.incomplete"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_message_items_and_a_forced_function_call(server: ThreadedServer) -> None:
    reply = client(server).responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}],
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=100,
    )
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS)
    follow = client(server).responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C"},
        ],
        tools=TOOLS,
        max_output_tokens=4,
    )
    assert follow.status in {"completed", "incomplete"}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "web_search"),
    ],
)
def test_refusals_name_the_field(
    server: ThreadedServer, fields: dict[str, object], named: str
) -> None:
    reply = httpx.post(
        f"{server.base_url}/v1/responses", json={"model": MODEL, "input": "hi", **fields}
    )
    assert reply.status_code == 400 and named in reply.json()["error"]["message"], reply.text
    with pytest.raises(openai.BadRequestError):
        client(server).responses.create(model=MODEL, input="hi", **fields)  # type: ignore[arg-type]
