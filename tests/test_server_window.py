"""Window fitting with the real ``openai`` client: ``--context-overflow drop-turns``
on chat and ``truncation: "auto"`` on Responses drop the oldest whole turns
(never the system prompt, never half a tool exchange) until the prompt fits
with room for max_tokens; the reply equals the reply to the kept turns sent
alone; the next turn reuses the session; the default still refuses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from serving import client, serving, sessions

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.server.schemas import Message
from turbospark.server.window import turn_starts
from turbospark.text import load_text

MODEL = "tiny-window"
CONTEXT = 256
SYSTEM = {"role": "system", "content": "Be brief."}
CALL = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}


def chat_of(turns: int) -> list[dict[str, Any]]:
    """A system prompt, then *turns* exchanges of about 40 tokens each, every
    other one a tool exchange, then the question."""
    out: list[dict[str, Any]] = [SYSTEM]
    for i in range(turns):
        out.append({"role": "user", "content": f"Question {i} about the weather here."})
        if i % 2:
            out.append({"role": "assistant", "content": "", "tool_calls": [CALL]})
            out.append({"role": "tool", "tool_call_id": "c1", "content": f"result {i}"})
        out.append({"role": "assistant", "content": f"Answer {i} is sunny."})
    out.append({"role": "user", "content": "And now?"})
    return out


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("window")
    build_synthetic_install("gemma4", path, vocab_size=128, num_layers=2, model_id=MODEL)
    return path


@pytest.fixture(scope="module")
def server(install: Path) -> Iterator[ThreadedServer]:
    with serving(
        install, load_text(install), slots=2, context=CONTEXT, context_overflow="drop-turns"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def refusing(install: Path) -> Iterator[ThreadedServer]:
    with serving(install, load_text(install), slots=2, context=CONTEXT) as running:
        yield running


def ask(server: ThreadedServer, messages: list[dict[str, Any]], max_tokens: int = 8) -> Any:
    return client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0
    )


def test_dropping_fits_keeps_the_system_prompt_and_whole_tool_exchanges(
    server: ThreadedServer,
) -> None:
    messages = chat_of(10)
    reply = ask(server, messages)
    dropped = reply.usage.turbospark["dropped_messages"]
    assert dropped > 0 and reply.usage.turbospark["dropped_tokens"] > 0
    assert reply.usage.prompt_tokens + 8 <= CONTEXT
    assert "dropped to fit the context" in reply.usage.turbospark["reuse_detail"]
    kept = [SYSTEM, *messages[1 + dropped :]]
    assert kept[1]["role"] == "user"  # whole turns: no orphaned tool result or call
    gone = messages[1 : 1 + dropped]
    assert sum(m["role"] == "tool" for m in gone) == sum("tool_calls" in m for m in gone)
    # The same reply as the kept turns sent alone (nothing dropped from them).
    alone = ask(server, kept)
    assert alone.usage.turbospark["dropped_messages"] == 0
    assert alone.choices[0].message.content == reply.choices[0].message.content
    assert alone.usage.prompt_tokens == reply.usage.prompt_tokens
    # The fewest turns: one turn fewer dropped would not fit.
    _, starts = turn_starts([Message.model_validate(m) for m in messages])
    at = starts.index(1 + dropped)
    fuller = [SYSTEM, *messages[starts[at - 1] :]]
    assert ask(server, fuller).usage.turbospark["dropped_messages"] > 0


def test_the_next_turn_reuses_the_session(server: ThreadedServer) -> None:
    messages = chat_of(10)
    first = ask(server, messages)
    again = ask(server, messages)  # the same drop: the session holds this prompt
    assert again.usage.turbospark["dropped_messages"] == first.usage.turbospark["dropped_messages"]
    assert again.usage.turbospark["reuse_reason"] in {"extends", "rewound"}
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
    assert "dropped to fit the context" in again.usage.turbospark["reuse_detail"]


def test_a_last_turn_too_long_is_refused_and_changes_nothing(server: ThreadedServer) -> None:
    before = sessions(server)
    messages = [SYSTEM, {"role": "user", "content": "x " * CONTEXT}]
    with pytest.raises(openai.BadRequestError, match="context length") as caught:
        ask(server, messages)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="lower max_tokens"):
        ask(server, chat_of(1), max_tokens=CONTEXT)
    assert sessions(server) == before


def test_the_default_refuses(refusing: ThreadedServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(refusing, chat_of(10))
    assert caught.value.code == "context_length_exceeded"


def test_responses_truncation_auto(refusing: ThreadedServer) -> None:
    items = [m for m in chat_of(12) if m["role"] in ("user", "assistant") and m["content"]]
    kwargs = dict(model=MODEL, instructions="Be brief.", max_output_tokens=8, temperature=0.0)
    with pytest.raises(openai.BadRequestError):
        client(refusing).responses.create(input=items, **kwargs)
    reply = client(refusing).responses.create(input=items, truncation="auto", **kwargs)
    assert reply.truncation == "auto" and reply.status in {"completed", "incomplete"}
    assert reply.usage.turbospark["dropped_messages"] > 0
    assert reply.usage.input_tokens + 8 <= CONTEXT
