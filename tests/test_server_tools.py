"""Tool calling over loopback with the real ``openai`` SDK and langchain: Qwen's
``<tool_call>`` shape rendered, forced by grammar, parsed back (streamed and not)."""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from serving import WEATHER_PARAMS as PARAMS
from serving import client, forced_call, serving

from turbospark import build_synthetic_install
from turbospark.errors import InstallError
from turbospark.generation.runner import Runner
from turbospark.loading.plugins import FamilyRegistry, default_registry
from turbospark.sdk import hookimpl
from turbospark.server import ThreadedServer
from turbospark.server.tools import StreamSplitter, parse
from turbospark.text import load_text

MODEL = "tiny-tools"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    path = tmp_path_factory.mktemp("tools-qwen")
    build_synthetic_install("qwen_gdn", path, vocab_size=160, num_layers=2, model_id=MODEL)
    with serving(path, load_text(path), slots=2) as running:
        yield running


def test_parse_and_stream_split() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    prose, calls = parse(text)
    assert prose == "Let me look." and calls[0].function.name == "f"
    assert json.loads(calls[0].function.arguments) == {"a": 1}
    assert parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    splitter = StreamSplitter()
    pieces = [
        splitter.feed(p)
        for p in ["Let me", " look.\n<tool", '_call>\n{"name"', ': "f"}\n</tool_call>']
    ]
    assert "".join(pieces) == "Let me look.\n"
    assert splitter.finish()[1][0].function.name == "f"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_well_formed_and_parsed(server: ThreadedServer, stream: bool) -> None:
    api = client(server)
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, seed=1)
    name, arguments = forced_call(api, stream, **kwargs)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), PARAMS)


def test_a_tool_round_trip_is_accepted(server: ThreadedServer) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C and sunny"},
    ]
    reply = client(server).chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=4
    )
    assert reply.choices[0].finish_reason in {"stop", "length", "tool_calls"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
    ],
)
def test_bad_tools_are_refused(
    server: ThreadedServer, fields: dict[str, object], param: str
) -> None:
    reply = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, **fields}
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_langchain_bind_tools(server: ThreadedServer) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL, max_tokens=200, seed=2
    )
    message = chat.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Rome?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], PARAMS)


def _gemma4_saying(name: str, syntax: str | None) -> types.ModuleType:
    """The gemma4 plugin's hooks in a module of its own whose tool syntax
    hook says *syntax* (None: the module has no such hook)."""
    plugin = types.ModuleType(name)
    source = default_registry().get("gemma4").plugin
    for attr in dir(source):
        if attr.startswith("turbospark_") and attr != "turbospark_tool_syntax":
            setattr(plugin, attr, getattr(source, attr))
    if syntax is not None:

        @hookimpl
        def turbospark_tool_syntax(chat_template: str | None) -> str:
            return syntax

        plugin.turbospark_tool_syntax = turbospark_tool_syntax
    return plugin


@pytest.mark.parametrize(("syntax", "named"), [(None, "qwen3_json"), ("qwen3_xml", "qwen3_xml")])
def test_the_family_names_its_tool_syntax(syntax: str | None, named: str, tmp_path: Path) -> None:
    registry = FamilyRegistry()
    registry.register(_gemma4_saying("gemma4_tools", syntax), name="gemma4")
    build_synthetic_install("gemma4", tmp_path, registry=registry, num_layers=2)
    runner = Runner.open(tmp_path, registry=registry)
    assert runner.tool_syntax(load_text(tmp_path).chat_template) == named


def test_a_tool_syntax_core_does_not_read_is_refused_by_name(tmp_path: Path) -> None:
    registry = FamilyRegistry()
    registry.register(_gemma4_saying("gemma4_yaml", "yaml"), name="gemma4")
    build_synthetic_install("gemma4", tmp_path, registry=registry, num_layers=2)
    runner = Runner.open(tmp_path, registry=registry)
    with pytest.raises(InstallError, match=r"family 'gemma4' names tool syntax 'yaml'"):
        runner.tool_syntax(None)
