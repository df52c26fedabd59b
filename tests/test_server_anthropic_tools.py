"""A whole Anthropic tool loop with the real ``anthropic`` SDK on every built-in
template shape (gemma4: alternating turns, tool results as a user turn;
qwen_gdn: ChatML): every shape the SDK sends (a ``tool_result`` with text in
one user turn, several results, ``tool_use`` with text in one assistant turn,
two user turns in a row) is rendered, and counted as it is served."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest
from serving import WEATHER_PARAMS as PARAMS
from serving import serving

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.text import load_text

MODEL = "tiny-anthropic-loop"
TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": PARAMS}]
ASK: dict[str, Any] = {"role": "user", "content": "Weather in Paris and Rome?"}


@pytest.fixture(scope="module", params=["gemma4", "qwen_gdn"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadedServer]:
    path = tmp_path_factory.mktemp(f"anthropic-loop-{request.param}")
    build_synthetic_install(request.param, path, vocab_size=160, num_layers=2, model_id=MODEL)
    with serving(path, load_text(path), slots=2) as running:
        yield running


def api(server: ThreadedServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def answered(server: ThreadedServer, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """The reply to *messages*, checked to be counted as it was served."""
    reply = api(server).messages.create(
        model=MODEL, max_tokens=200, messages=messages, tools=TOOLS, **kwargs
    )
    counted = api(server).messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    return reply


def test_a_whole_tool_loop(server: ThreadedServer) -> None:
    first = answered(server, [ASK], tool_choice={"type": "any"})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses
    jsonschema.validate(uses[0].input, PARAMS)
    # The SDK's own shapes: the reply sent back as it came (tool_use blocks, with
    # text when it had some), then one user turn holding the result and more text.
    turn = [b.model_dump(exclude_none=True) for b in first.content]
    said = {"type": "text", "text": "Checking."}
    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "18C"}
    loop = [ASK, {"role": "assistant", "content": [said, *turn]}]
    second = answered(
        server,
        [*loop, {"role": "user", "content": [result, {"type": "text", "text": "And Rome?"}]}],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert second.stop_reason == "tool_use"
    again = next(b for b in second.content if b.type == "tool_use")
    # Several results in one turn, an error among them; then the answer, in words.
    results = [
        result,
        {"type": "tool_result", "tool_use_id": again.id, "content": "no data", "is_error": True},
    ]
    both = [
        *loop,
        {"role": "user", "content": [result, {"type": "text", "text": "And Rome?"}]},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
        {"role": "user", "content": results},
    ]
    last = answered(server, both, tool_choice={"type": "none"}, extra_body={"temperature": 0.0})
    assert last.stop_reason in {"end_turn", "max_tokens"}
    assert all(b.type == "text" for b in last.content)


def test_two_user_turns_in_a_row_are_one(server: ThreadedServer) -> None:
    """Anthropic merges consecutive user turns; alternating templates would refuse them."""
    apart = [ASK, {"role": "user", "content": "Only Paris."}]
    together = [{"role": "user", "content": f"{ASK['content']}\n\nOnly Paris."}]
    one = answered(server, apart, extra_body={"temperature": 0.0})
    other = answered(server, together, extra_body={"temperature": 0.0})
    assert one.content == other.content
    assert one.usage.input_tokens + one.usage.cache_read_input_tokens == (
        other.usage.input_tokens + other.usage.cache_read_input_tokens
    )


def test_a_tool_use_in_a_user_turn_is_refused_by_name(server: ThreadedServer) -> None:
    block = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    with pytest.raises(anthropic.BadRequestError, match="tool_use blocks"):
        api(server).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [block]}]
        )
