"""Ollama's API over loopback with the real ``ollama`` client, on both
families: chat (streamed and not), generate, list, show, ps, version, embed,
``format`` as a schema, tools, ``options`` and ``keep_alive``. Each answer is
held equal to the same request through the OpenAI routes (one decode path)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from serving import WEATHER_PARAMS, client, serving, sessions

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.text import load_text

MODEL = "tiny-ollama"
GREEDY = {"temperature": 0, "num_predict": 6}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Plan a three day walk along the coast, please."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                           "parameters": WEATHER_PARAMS}}]  # fmt: skip


def build(family: str, path: Path) -> Path:
    extra = {"sliding_window": 8} if family == "gemma4" else {}
    build_synthetic_install(family, path, vocab_size=160, num_layers=2, model_id=MODEL, **extra)
    return path


@pytest.fixture(scope="module", params=["gemma4", "qwen_gdn"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadedServer]:
    path = build(request.param, tmp_path_factory.mktemp(f"ollama-{request.param}"))
    with serving(path, load_text(path), slots=3) as running:
        yield running


def api(server: ThreadedServer) -> ollama.Client:
    return ollama.Client(host=server.base_url)


def openai_chat(server: ThreadedServer, messages: list[dict[str, Any]], **extra: Any) -> str:
    reply = client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, **extra
    )
    return reply.choices[0].message.content or ""


def test_chat_streamed_and_not_equals_the_openai_route(server: ThreadedServer) -> None:
    reply = api(server).chat(model=MODEL, messages=CHAT, options=GREEDY)
    assert reply.done and reply.done_reason in {"stop", "length"}
    assert reply.eval_count <= 6 and reply.prompt_eval_count > 0
    assert reply.message.content == openai_chat(server, CHAT)
    parts = list(api(server).chat(model=f"{MODEL}:latest", messages=CHAT, options=GREEDY, stream=True))  # fmt: skip
    assert [p.done for p in parts][-1] and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == reply.message.content


def test_generate_equals_chat_and_raw_equals_completions(server: ThreadedServer) -> None:
    made = api(server).generate(model=MODEL, prompt=CHAT[1]["content"], system=CHAT[0]["content"],
                                options=GREEDY)  # fmt: skip
    assert made.response == api(server).chat(model=MODEL, messages=CHAT, options=GREEDY).message.content  # fmt: skip
    assert len(made.context) > made.eval_count  # the prompt's ids, then the reply's
    raw = api(server).generate(model=MODEL, prompt="Once upon a time", raw=True, options=GREEDY)
    plain = client(server).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0
    )
    assert raw.response == plain.choices[0].text


def test_options_map_to_the_sampler(server: ThreadedServer) -> None:
    greedy = api(server).chat(model=MODEL, messages=CHAT, options=GREEDY).message.content
    top1 = {"temperature": 1.0, "top_k": 1, "num_predict": 6}
    assert api(server).chat(model=MODEL, messages=CHAT, options=top1).message.content == greedy
    seeded = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 7, "num_predict": 6}
    once, again = (
        api(server).chat(model=MODEL, messages=CHAT, options=seeded).message.content
        for _ in range(2)
    )
    assert once == again
    short = api(server).chat(model=MODEL, messages=CHAT, options={**GREEDY, "num_predict": 2})
    assert short.eval_count <= 2
    penalised = {
        **GREEDY,
        "repeat_penalty": 1.5,
        "num_ctx": 99,
        "mirostat": 2,
    }  # the last two: ignored
    assert api(server).chat(model=MODEL, messages=CHAT, options=penalised).message.content == (
        openai_chat(server, CHAT, extra_body={"repetition_penalty": 1.5})
    )


def test_format_schema_and_json(server: ThreadedServer) -> None:
    reply = api(server).chat(model=MODEL, messages=CHAT, format=WEATHER_PARAMS,
                             options={"num_predict": 60})  # fmt: skip
    jsonschema.validate(json.loads(reply.message.content), WEATHER_PARAMS)
    loose = api(server).generate(model=MODEL, prompt="JSON please.", format="json",
                                 options={"num_predict": 60})  # fmt: skip
    if loose.done_reason == "stop":
        assert isinstance(json.loads(loose.response), dict)


def test_tools_and_their_results_map_to_the_chat_route(server: ThreadedServer) -> None:
    history = [
        *CHAT,
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "18C and sunny"},
    ]  # fmt: skip
    reply = api(server).chat(model=MODEL, messages=history, tools=TOOLS, options=GREEDY)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome", "days": 2})}}  # fmt: skip
    same = [
        *CHAT,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ]
    assert reply.message.content == openai_chat(server, same, tools=TOOLS)


def test_list_show_ps_version(server: ThreadedServer) -> None:
    (card,) = api(server).list().models
    assert card.model == f"{MODEL}:latest" and card.size > 0 and card.details.family
    shown = api(server).show(MODEL)
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == card.details.family
    (loaded,) = api(server).ps().models
    assert loaded.model == card.model and loaded.context_length == 2048
    assert httpx.get(f"{server.base_url}/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as refused:
        api(server).show("other-model")
    assert refused.value.status_code == 404 and "other-model" in refused.value.error


def test_embed_equals_the_openai_route(server: ThreadedServer) -> None:
    texts = ["a coastal walk", "lemon cake"]
    ours = api(server).embed(model=MODEL, input=texts).embeddings
    theirs = client(server).embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for vector, item in zip(ours, theirs.data, strict=True):
        assert vector == pytest.approx(item.embedding, abs=1e-6)
    legacy = api(server).embeddings(model=MODEL, prompt=texts[0]).embedding
    assert legacy == pytest.approx(ours[0], abs=1e-6)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"keep_alive": "5 minutes"}, "keep_alive"),
        ({"keep_alive": True}, "keep_alive"),
        ({"options": {"num_predict": -3}}, "num_predict"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "x"}}],
                    }
                ]
            },
            "arguments",
        ),
        ({"options": {"temperature": 5}}, "temperature"),
        ({"format": "yaml"}, "format"),
        ({"think": True}, "think"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
        ({"model": "other-model"}, "other-model"),
    ],
)
def test_bad_input_is_one_line_and_changes_no_session(
    server: ThreadedServer, body: dict[str, Any], named: str
) -> None:
    before = sessions(server)
    sent = {"model": MODEL, "messages": CHAT, "stream": False, **body}
    reply = httpx.post(f"{server.base_url}/api/chat", json=sent)
    assert reply.status_code in {400, 404}, reply.text
    error = reply.json()["error"]
    assert isinstance(error, str) and named in error and "\n" not in error
    assert sessions(server) == before


def test_keep_alive_zero_drops_the_session(tmp_path: Path) -> None:
    path = build("gemma4", tmp_path)
    with serving(path, load_text(path), slots=3) as running:
        api(running).chat(model=MODEL, messages=CHAT, options=GREEDY)
        assert any(position for _, position, _ in sessions(running))
        api(running).chat(model=MODEL, messages=CHAT, options=GREEDY, keep_alive=0)
        assert not any(position for _, position, _ in sessions(running))


@pytest.mark.slow  # two servers, five conversations each: ~5 s
def test_keep_alive_keeps_a_session_parked_past_the_lru_rule(tmp_path: Path) -> None:
    path = build("gemma4", tmp_path)
    others = ["Which tea goes with lemon cake?", "Name a river.", "Count to three."]

    def resumed(keep_alive: str | None) -> int:
        """Prompt tokens kept when the first conversation comes back after three others."""
        with serving(path, load_text(path), slots=3) as running:
            first = api(running).chat(
                model=MODEL, messages=CHAT, options=GREEDY, keep_alive=keep_alive
            )
            for text in others:
                api(running).chat(model=MODEL, messages=[{"role": "user", "content": text}],
                                  options=GREEDY)  # fmt: skip
            again = [*CHAT, first.message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Thanks."}]  # fmt: skip
            sent = {"model": MODEL, "messages": again, "stream": False, "options": GREEDY}
            usage = httpx.post(f"{running.base_url}/api/chat", json=sent).json()["turbospark"]
            return usage["reuse_reason"]

    dropped, kept = resumed(None), resumed("1h")
    assert dropped not in {"extends", "rewound"} and kept in {"extends", "rewound"}, (dropped, kept)
