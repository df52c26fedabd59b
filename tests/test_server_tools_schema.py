"""Forced tool calls over loopback on both families (random weights): the
arguments validate against the tool's schema, feature by feature, through the
real ``openai`` client, and the agent frameworks built on tool calls (instructor,
langchain, pydantic-ai, openai's ``pydantic_function_tool``) get a valid object
back. Every field is bounded so a random-weight model cannot run on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from serving import client, serving
from test_tools_schema_grammar import DEFS, FEATURES, parameters

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.text import load_text

MODEL = "tiny-schema-tools"
ASK = [{"role": "user", "content": "Fill it in."}]
FAST = ["string_bounds", "pattern", "enum", "integer_bounds", "array_counts", "ref"]


@pytest.fixture(scope="module", params=["qwen_gdn", "gemma4"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadedServer]:
    path = tmp_path_factory.mktemp(request.param)
    build_synthetic_install(request.param, path, vocab_size=160, num_layers=2, model_id=MODEL)
    with serving(path, load_text(path), slots=2) as running:
        yield running


def forced(server: ThreadedServer, params: dict, seed: int) -> dict:
    tool = {"type": "function", "function": {"name": "fill", "parameters": params}}
    reply = client(server).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "fill"}},
        max_tokens=400,
        seed=seed,
    )
    assert reply.choices[0].finish_reason == "tool_calls", reply
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "fill"
    return json.loads(call.function.arguments)


@pytest.mark.parametrize(
    "feature",
    [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FEATURES],
)
def test_a_forced_call_follows_each_feature(server: ThreadedServer, feature: str) -> None:
    params = parameters(FEATURES[feature])
    for seed in (1, 2):
        arguments = forced(server, params, seed)
        jsonschema.validate(arguments, params, format_checker=jsonschema.FormatChecker())


def test_a_strict_tool_with_every_feature_at_once(server: ThreadedServer) -> None:
    params = {
        "type": "object",
        "properties": {k: FEATURES[k] for k in FAST},
        "required": FAST,
        "additionalProperties": False,
        "$defs": DEFS,
    }
    tool = {"type": "function", "function": {"name": "fill", "parameters": params, "strict": True}}
    reply = client(server).chat.completions.create(
        model=MODEL, messages=ASK, tools=[tool], tool_choice="required", max_tokens=600, seed=3,
        stream=True,
    )  # fmt: skip
    calls = [t for e in reply for c in e.choices for t in c.delta.tool_calls or []]
    jsonschema.validate(json.loads(calls[0].function.arguments), params)


# -- the frameworks -----------------------------------------------------------------------


class Stop(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Annotated[str, Field(min_length=1, max_length=8)]
    nights: Annotated[int, Field(ge=1, le=9)]


class Trip(BaseModel):
    """A short trip."""

    model_config = ConfigDict(extra="forbid")

    title: Annotated[str, Field(max_length=12, pattern=r"^[A-Z]")]
    mode: Literal["train", "car"]
    stops: Annotated[list[Stop], Field(min_length=1, max_length=2)]
    budget: Annotated[float, Field(ge=0, le=5000)]


def base_url(server: ThreadedServer) -> str:
    return f"{server.base_url}/v1"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Mode.TOOLS_STRICT is deprecated:DeprecationWarning")
@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT"])
def test_instructor(server: ThreadedServer, mode: str) -> None:
    import instructor

    api = instructor.from_openai(client(server), mode=getattr(instructor.Mode, mode))
    trip = api.chat.completions.create(
        model=MODEL, messages=ASK, response_model=Trip, max_tokens=400, max_retries=0, seed=4
    )
    assert isinstance(trip, Trip)


@pytest.mark.slow
def test_langchain_with_structured_output(server: ThreadedServer) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=base_url(server), api_key="unused", model=MODEL, max_tokens=400, seed=5
    )
    trip = chat.with_structured_output(Trip, method="function_calling").invoke("Plan a trip.")
    assert isinstance(trip, Trip)


@pytest.mark.slow
def test_pydantic_ai_tool_output(server: ThreadedServer) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client_async(server)))
    agent = Agent(model, output_type=Trip, retries=0, model_settings={"max_tokens": 400})
    assert isinstance(agent.run_sync("Plan a trip.").output, Trip)


def client_async(server: ThreadedServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0)


@pytest.mark.slow
def test_openai_pydantic_function_tool(server: ThreadedServer) -> None:
    tool = openai.pydantic_function_tool(Trip)
    reply = client(server).chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Trip"}},
        max_tokens=400,
        seed=6,
    )
    assert isinstance(reply.choices[0].message.tool_calls[0].function.parsed_arguments, Trip)
