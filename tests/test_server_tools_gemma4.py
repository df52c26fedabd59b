"""Gemma 4 tool calling over loopback with the real ``openai`` SDK: the synthetic
gemma4 template renders tools, calls and results in Gemma 4's native syntax, a
forced call follows the grammar, and the reply's calls are parsed back (streamed
and not)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from serving import WEATHER_PARAMS as PARAMS
from serving import client, forced_call, serving

from turbospark import build_synthetic_install
from turbospark.sdk import family_hooks
from turbospark.server import ThreadedServer
from turbospark.server.tools import GEMMA4_SYNTAX, StreamSplitter, ToolSyntax
from turbospark.text import TextCodec, load_text
from turbospark.text.templates import compile_template

MODEL = "tiny-gemma-tools"
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather.", "parameters": PARAMS},
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C and sunny"},
]
Q = '<|"|>'


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TextCodec]:
    path = tmp_path_factory.mktemp("tools-gemma4")
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, sliding_window=8, model_id=MODEL
    )
    return path, load_text(path)


@pytest.fixture(scope="module")
def server(codec: tuple[Path, TextCodec]) -> Iterator[ThreadedServer]:
    with serving(codec[0], codec[1], slots=2) as running:
        yield running


def test_the_template_writes_gemma4_tool_syntax(codec: tuple[Path, TextCodec]) -> None:
    text_codec = codec[1]
    name = family_hooks("gemma4").turbospark_tool_syntax(chat_template=text_codec.chat_template)
    assert ToolSyntax.named(name) is GEMMA4_SYNTAX
    messages = [
        CALLED[0],
        {
            **CALLED[1],
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                }
            ],
        },
        CALLED[2],
    ]
    text = text_codec.apply_chat_template(messages, tools=TOOLS)
    declaration = (
        f"<|tool>declaration:get_weather{{description:{Q}The weather.{Q},parameters:"
        f"{{type:{Q}object{Q},properties:{{city:{{enum:[{Q}Paris{Q},{Q}Rome{Q}]}},"
    )
    assert declaration in text
    assert f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>" in text
    assert f"<|tool_response>response:get_weather{{value:{Q}18C and sunny{Q}}}" in text
    assert text.endswith("<|turn>model\n")


def test_stream_split_in_gemma4_syntax() -> None:
    splitter = StreamSplitter(GEMMA4_SYNTAX)
    pieces = ["Sure.", "<|tool", f"_call>call:f{{a:{Q}x", f"{Q}}}<tool_call|>"]
    assert "".join(splitter.feed(p) for p in pieces) == "Sure."
    _, calls = splitter.finish()
    assert calls[0].function.name == "f" and json.loads(calls[0].function.arguments) == {"a": "x"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_gemma4_call_is_parsed(server: ThreadedServer, stream: bool) -> None:
    api = client(server)
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, seed=1)
    name, arguments = forced_call(api, stream, **kwargs)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), PARAMS)


def test_a_gemma4_tool_round_trip_is_accepted(server: ThreadedServer) -> None:
    reply = client(server).chat.completions.create(
        model=MODEL, messages=CALLED, tools=TOOLS, max_tokens=4
    )
    assert reply.choices[0].finish_reason in {"stop", "length", "tool_calls"}


def test_a_template_without_tools_still_refuses_them(codec: tuple[Path, TextCodec]) -> None:
    plain = copy.copy(codec[1])
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    plain._template = compile_template(plain.chat_template)
    with serving(codec[0], plain, slots=1) as running:
        reply = httpx.post(
            f"{running.base_url}/v1/chat/completions",
            json={"model": MODEL, "messages": ASK, "tools": TOOLS},
            timeout=30,
        )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "tools" and "chat template" in error["message"]
