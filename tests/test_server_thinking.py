"""Thinking control over loopback with the real clients: ``chat_template_kwargs``
reaches the template (Qwen3.5's ``enable_thinking``), the reply's reasoning is
split off into ``reasoning_content`` (streamed as ``delta.reasoning_content``)
and Anthropic ``thinking`` blocks, exactly as the raw reply splits; bad
arguments are refused and change no session; a second turn's reuse is named."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from serving import client, serving, sessions

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.server.reasoning import Reasoning
from turbospark.text import TextCodec, load_text

MODEL = "tiny-thinking"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.mark.parametrize("opened", [True, False])
@pytest.mark.parametrize(
    "text",
    ["plain answer", "  <think>r</think>\n\nans", "reason</think>\n\nanswer</thi", "<thi", "r</"],
)
def test_streamed_split_equals_the_whole_split(opened: bool, text: str) -> None:
    whole = Reasoning(opened).split(text)
    for size in (1, 2, 3, len(text)):
        splitter = Reasoning(opened).splitter()
        parts = [splitter.feed(text[i : i + size]) for i in range(0, len(text), size)]
        parts.append(splitter.finish())
        thought, answer = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (thought if splitter.reasoned else None, answer) == whole
    if opened:
        assert whole[0] is not None and "</think>" not in whole[0] + whole[1][:0]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, TextCodec]:
    path = tmp_path_factory.mktemp("thinking-qwen")
    build_synthetic_install("qwen_gdn", path, vocab_size=160, num_layers=2, model_id=MODEL)
    return path, load_text(path)


@pytest.fixture(scope="module")
def server(installed: tuple[Any, TextCodec]) -> Iterator[ThreadedServer]:
    with serving(installed[0], installed[1], slots=2) as running:
        yield running


# The synthetic Qwen template thinks when asked (the checkpoints' template by default).
THINK = {"chat_template_kwargs": {"enable_thinking": True}}


def chat(server: ThreadedServer, messages: list[dict[str, Any]], **extra: Any) -> Any:
    extra.setdefault("extra_body", THINK)
    return client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0.0, **extra
    )


def test_enable_thinking_reaches_the_template(server: ThreadedServer) -> None:
    on = chat(server, ASK)
    off = chat(server, ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # "<think>\n" against "<think>\n\n</think>\n\n": the empty block's close, 3 tokens more.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]
    assert off.choices[0].message.content


def test_the_reasoning_is_the_raw_reply_split(
    server: ThreadedServer, installed: tuple[Any, TextCodec]
) -> None:
    codec = installed[1]
    close = codec.tokenizer.token_to_id("</think>")
    bias = {"logit_bias": {str(close): 6.0}}  # the block closes somewhere in the reply
    reply = chat(server, ASK, **bias)
    message = reply.choices[0].message
    prompt = codec.apply_chat_template(ASK, enable_thinking=True)
    raw = client(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0, **bias
    )
    assert (message.reasoning_content, message.content or "") == Reasoning(True).split(  # type: ignore[attr-defined]
        raw.choices[0].text
    )
    deltas = list(
        client(server).chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=24,
            temperature=0.0,
            stream=True,
            extra_body=THINK,
            **bias,
        )
    )
    thought = "".join(getattr(d.choices[0].delta, "reasoning_content", None) or "" for d in deltas)
    said = "".join(d.choices[0].delta.content or "" for d in deltas)
    assert (thought, said) == (message.reasoning_content, message.content or "")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ("yes", "chat_template_kwargs"),
        ([1], "chat_template_kwargs"),
        ({"messages": []}, "'messages'"),
    ],
)
def test_bad_template_kwargs_are_a_400_and_change_no_session(
    server: ThreadedServer, kwargs: Any, named: str
) -> None:
    chat(server, ASK)
    before = sessions(server)
    body = {"model": MODEL, "messages": ASK, "chat_template_kwargs": kwargs}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert reply.status_code == 400 and named in reply.json()["error"]["message"]
    assert sessions(server) == before


def test_a_second_turn_names_its_reuse(server: ThreadedServer) -> None:
    """The template drops an earlier turn's reasoning, so the second prompt leaves
    the first one's record where the reply began; on recurrent state (qwen_gdn)
    only a checkpoint at or below that point can be used: the one taken where
    the generation prompt began, and the report says so. A tool loop's turn keeps its reasoning (sent back as reasoning_content):
    the record extends to the reasoning, and the prompt-end checkpoint is used."""
    first = chat(server, ASK)
    thought = first.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    second = chat(
        server,
        [*ASK, {"role": "assistant", "content": first.choices[0].message.content or "ok"},
         {"role": "user", "content": "Thanks."}],
    )  # fmt: skip
    assert second.usage.turbospark["reuse_reason"] == "checkpoint"
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    assert second.usage.turbospark["reuse_detail"]
    chat(server, ASK)  # the first turn again, live
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    looped = chat(
        server,
        [*ASK, {"role": "assistant", "content": "", "reasoning_content": thought,
                "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c1", "content": "Rayleigh."}],
    )  # fmt: skip
    assert looped.usage.turbospark["reuse_reason"] == "checkpoint"
    assert looped.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens


def test_anthropic_thinking_blocks(server: ThreadedServer) -> None:
    api = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = dict(
        model=MODEL, max_tokens=2048, messages=ASK, extra_body={"temperature": 0.0}
    )
    thinking = {"type": "enabled", "budget_tokens": 1024}
    whole = api.messages.create(**kwargs, thinking=thinking)  # type: ignore[arg-type]
    assert whole.content[0].type == "thinking"
    with api.messages.stream(**kwargs, thinking=thinking) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    streamed = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")  # fmt: skip
    assert streamed == whole.content[0].thinking == final.content[0].thinking  # type: ignore[union-attr]
    plain = api.messages.create(**kwargs)
    assert all(b.type == "text" for b in plain.content)
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        api.messages.create(**{**kwargs, "max_tokens": 100}, thinking=thinking)  # type: ignore[arg-type]
