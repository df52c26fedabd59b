"""The OpenAI-compatible server, over real loopback TCP with the official ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving import CONTEXT, client, serving

from turbospark.cli import main
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.server import ThreadedServer, create_app
from turbospark.text import TextCodec

MODEL = "tiny-serve"


@pytest.fixture(scope="module")
def server(install: Path, codec: TextCodec) -> Iterator[ThreadedServer]:
    with serving(install, codec, slots=2) as running:
        yield running


def greedy_reference(install: Path, codec: TextCodec, prompt: list[int] | str, n: int) -> str:
    """The Python API on its own runner, in this thread."""
    runner = Runner.open(install, context_length=CONTEXT)
    return generate(runner, codec, prompt, GenerationConfig(max_tokens=n)).text


def usage_extension(usage: object) -> dict[str, object]:
    return usage.model_extra["turbospark"]  # type: ignore[attr-defined]


def test_two_interleaved_conversations_on_two_slots(install: Path, codec: TextCodec) -> None:
    """SEMANTICS' server scenario: A1, B1, A2, B2 on --session-slots 2."""
    a = [{"role": "user", "content": "Alice would like to plan a long walking trip in the Alps."}]
    b = [{"role": "user", "content": "Bob needs a recipe for a quick vegetable soup tonight."}]
    with serving(install, codec, slots=2) as running:
        api = client(running)

        def turn(messages: list[dict[str, str]], follow_up: str | None) -> tuple[list[int], object]:
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
            reply = api.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
            prompt = codec.encode_chat(messages)
            # A later turn carries the re-sent reply as its generated ids, whitespace
            # the template trims included (SEMANTICS.md), not as the template's text.
            assert follow_up is not None or reply.usage.prompt_tokens == len(prompt)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            return prompt, reply.usage

        a1_prompt, a1 = turn(a, None)
        b1_prompt, b1 = turn(b, None)
        _, a2 = turn(a, "And which huts should she book along the way?")
        _, b2 = turn(b, "Can it be made without onions, please?")

    cached = [u.prompt_tokens_details.cached_tokens for u in (a1, b1, a2, b2)]
    extensions = [usage_extension(u) for u in (a1, b1, a2, b2)]
    # The only thing A1 and B1 share is the template's opening (capped as SEMANTICS says).
    shared = next(i for i, (x, y) in enumerate(zip(a1_prompt, b1_prompt, strict=False)) if x != y)
    overlap = min(shared, len(b1_prompt) - 1)
    assert codec.decode(b1_prompt[:shared], skip_special_tokens=False) == ("<bos><|turn>user\n")
    assert cached[0] == 0
    # B1 matches only that opening: rewinding A to it would overwrite A (the shallow-match
    # rule), so A is parked and B1 starts from the opening it shares with the parked A.
    assert cached[1] == overlap and extensions[1]["reuse_reason"] == "shared_prefix"
    # Each continuation finds its own conversation (swapped in from the pool) past its first turn.
    assert cached[2] > cached[1] and cached[2] >= len(a1_prompt)
    assert cached[3] > cached[1] and cached[3] >= len(b1_prompt)
    assert extensions[2]["swapped"] and extensions[3]["swapped"]
    assert not any(e["evicted"] for e in extensions)


def test_greedy_text_matches_the_python_api(
    server: ThreadedServer, install: Path, codec: TextCodec
) -> None:
    api = client(server)
    messages = [{"role": "user", "content": "Write one line about the sea."}]
    expected = greedy_reference(install, codec, codec.encode_chat(messages), 12)
    whole = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "length"
    stream = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = list(stream)
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == expected
    assert events[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again

    raw = "Once upon a time"
    completion = api.completions.create(model=MODEL, prompt=raw, max_tokens=10, temperature=0)
    assert completion.choices[0].text == greedy_reference(install, codec, raw, 10)


def test_seeded_sampling_is_reproducible_over_http(server: ThreadedServer) -> None:
    api = client(server)
    messages = [{"role": "user", "content": "Surprise me."}]

    def sample(seed: int) -> str:
        reply = api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=1.2, seed=seed
        )
        return reply.choices[0].message.content

    assert sample(11) == sample(11)


def test_models_and_health(server: ThreadedServer) -> None:
    assert [m.id for m in client(server).models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").json() == {
        "status": "ok",
        "model": MODEL,
        "queue_depth": 0,
        "active_rows": 0,
        "max_batch": 8,
    }


def chat_body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b'{"model": "tiny-serve", "messages": [', 400, None, "invalid_json"),
        (
            json.dumps(
                {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            404,
            "model",
            "model_not_found",
        ),
        (chat_body(messages=[]), 400, "messages", "invalid_value"),
        (
            chat_body(messages=[{"role": "user", "content": "x" * (CONTEXT + 10)}]),
            400,
            "messages",
            "context_length_exceeded",
        ),
        (
            chat_body(messages=[{"role": "user", "content": "hi"}], max_tokens=-1),
            400,
            "max_tokens",
            "invalid_value",
        ),
        (chat_body(), 400, "messages", "missing_required_parameter"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server: ThreadedServer, body: bytes, status: int, param: str | None, code: str
) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert error["message"]
    good = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=2
    )
    assert good.choices[0].finish_reason in {"stop", "length"}


def test_unknown_routes_answer_in_the_same_error_shape(server: ThreadedServer) -> None:
    response = httpx.get(f"{server.base_url}/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_a_client_hanging_up_mid_stream_leaves_the_session_reusable(
    install: Path, codec: TextCodec
) -> None:
    messages = [{"role": "user", "content": "Recite a very long poem about mountains."}]
    prompt = codec.encode_chat(messages)
    limit = 1500
    with serving(install, codec, slots=2) as running:
        request = chat_body(messages=messages, max_tokens=limit, temperature=0, stream=True)
        url = f"{running.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, content=request, timeout=30) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(3), strict=False) if line]
        assert received  # the stream had started when the client left

        again = client(running).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0
        )
    extension = usage_extension(again.usage)
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    assert extension["reuse_reason"] == "rewound"
    dropped = int(str(extension["reuse_detail"]).split()[1])  # "rewound N token(s) ..."
    assert dropped < limit - 1  # generation stopped when the client left, not at max_tokens
    assert again.choices[0].message.content == greedy_reference(install, codec, prompt, 6)


def test_serve_refuses_a_pool_without_prefix_reuse(
    install: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(install), "--session-slots", "2", "--no-prefix-reuse"]) == 2
    assert "--no-prefix-reuse" in capsys.readouterr().err


def test_create_app_serves_a_runner_opened_on_another_thread(
    install: Path, codec: TextCodec
) -> None:
    """Without a worker, the app evaluates what the opening thread left lazy."""
    runner = Runner.open(install, context_length=CONTEXT)
    with ThreadedServer(create_app(runner, codec, model_id="other")) as running:
        reply = client(running).chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert reply.usage.completion_tokens <= 3
