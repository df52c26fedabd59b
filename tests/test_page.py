"""``GET /turbospark/sessions`` and ``GET /``: the schema, what the view reports,
and that it never reveals a conversation (its token ids or its text)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import CONTEXT, client, service, serving, serving_with_disk

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.server.sessions import SessionsView
from turbospark.text import TextCodec, load_text

MODEL = "tiny-sessions"
# Words no template, reason or file name contains, so finding one means text leaked.
ALICE = "Alice packs marzipan, tarragon and binoculars for Ljubljana."
ALICE_MORE = "Can Quentin carry the hammock?"
BOB = "Bob's xylophone recital is on Wednesday."


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The hybrid family: its sessions carry prompt-boundary checkpoints.
    path = tmp_path_factory.mktemp("sessions-qwen-gdn")
    build_synthetic_install("qwen_gdn", path, vocab_size=128, num_layers=4, model_id=MODEL)
    return path


@pytest.fixture(scope="module")
def codec(install: Path) -> TextCodec:
    return load_text(install)


def view(server: ThreadedServer) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/turbospark/sessions")
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    body = response.json()
    SessionsView.model_validate(body)  # every field known (extra="forbid"), every type right
    return body


def chat(server: ThreadedServer, messages: list[dict[str, str]]) -> str:
    reply = client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    text = reply.choices[0].message.content
    messages.append({"role": "assistant", "content": text})
    return text


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            assert isinstance(item, dict), f"{path}[{i}] is a list of values, not of records"
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def assert_private(body: dict[str, Any], ids: list[list[int]], texts: list[str]) -> None:
    """No piece of any conversation: no list of numbers at all (ids could hide in
    one), no run of a prompt's ids among the numbers in document order, and no
    word or reply of the conversations in any string."""
    found = list(leaves(body))  # also asserts every list holds records only
    numbers = [v for _, v in found if isinstance(v, int) and not isinstance(v, bool)]
    strings = [v for _, v in found if isinstance(v, str)]
    for prompt in ids:
        for start in range(len(prompt) - 3):
            run = prompt[start : start + 4]
            assert not any(numbers[i : i + 4] == run for i in range(len(numbers))), run
    words = {w for text in texts for w in re.findall(r"[A-Za-z]{6,}", text)}
    assert words, "the check needs words to look for"
    for string in strings:
        for word in words:
            assert word.lower() not in string.lower(), (word, string)
        for text in texts:
            assert len(text.strip()) < 4 or text.strip() not in string, (text, string)


def test_the_view_reports_every_session_and_reveals_none(
    install: Path, codec: TextCodec, tmp_path: Path
) -> None:
    alice = [{"role": "user", "content": ALICE}]
    bob = [{"role": "user", "content": BOB}]
    with serving_with_disk(install, codec, tmp_path / "sessions", slots=4) as server:
        empty = view(server)
        assert empty["sessions"] == [] and empty["pool"]["empty_slots"] == 4
        replies = [chat(server, alice)]
        alice.append({"role": "user", "content": ALICE_MORE})
        replies.append(chat(server, alice))
        replies.append(chat(server, bob))
        body = view(server)
        runner = service(server).runner
        memory = service(server).engine.call(
            lambda: [(s.conversation, s.position, s.nbytes) for s in runner.sessions()]
        )
        truth = {c: (p, n) for c, p, n in memory.result() if p}

    assert body["model"] == MODEL and body["family"] == "qwen_gdn"
    assert body["context_length"] == CONTEXT
    assert body["engine"]["active_rows"] == 0 and body["engine"]["queue_depth"] == 0
    sessions = body["sessions"]
    # Bob's turn is live (used last); Alice's conversation, two turns deep, is parked.
    assert [(s["where"], s["last_used"]) for s in sessions] == [("live", 0), ("parked", 1)]
    live, parked = sessions
    assert {s["conversation"]: (s["tokens"], s["bytes"]) for s in sessions} == truth
    bob_prompt = len(codec.encode_chat(bob[:1]))
    alice_prompt = len(codec.encode_chat(alice[:3]))
    assert bob_prompt <= live["tokens"] <= bob_prompt + 8
    assert alice_prompt <= parked["tokens"] <= alice_prompt + 8
    for s in sessions:
        assert not s["tainted"] and s["request"] is None
        assert s["checkpoints"] >= 1 and 0 < s["newest_checkpoint"] <= s["tokens"]
        assert s["file"] and s["saved"]  # write-through: each reply is a session on disk
    # Two per turn of Alice's: where the generation prompt starts, and the prompt's end.
    assert parked["checkpoints"] == 4
    pool = body["pool"]
    assert pool["slots"] == 4 and pool["empty_slots"] == 2 and pool["evictions"] == 0
    assert (pool["live_bytes"], pool["parked_bytes"]) == (live["bytes"], parked["bytes"])
    assert pool["max_parked_bytes"] is None
    disk = body["disk"]
    assert disk["files"] == 2 and disk["evictions"] == 0 and disk["rejected"] == 0
    files = {e["file"]: e for e in disk["entries"]}
    assert set(files) == {live["file"], parked["file"]}
    assert all(e["in_memory"] for e in files.values())
    assert files[live["file"]]["last_used"] == 0  # written last
    assert disk["bytes"] == sum(e["bytes"] for e in files.values()) > 0

    ids = [codec.encode_chat(alice[:3]), codec.encode_chat(bob)]
    assert_private(body, ids, [ALICE, ALICE_MORE, BOB, *replies])
    # The check itself can fail: a view carrying a record would be caught.
    leaky = json.loads(json.dumps(body))
    leaky["sessions"][0]["tokens_seen"] = ids[1]
    with pytest.raises(AssertionError):
        assert_private(leaky, ids, [ALICE])
    leaky = json.loads(json.dumps(body))
    leaky["sessions"][0]["request"] = {"reuse_detail": f"matched '{BOB[:20]}'"}
    with pytest.raises(AssertionError):
        assert_private(leaky, ids, [BOB])


def test_a_request_in_flight_is_an_active_row(install: Path, codec: TextCodec) -> None:
    messages = [{"role": "user", "content": ALICE}]
    with serving(install, codec, slots=2) as server:
        stream = client(server).chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=CONTEXT,  # the context length stops it: long enough to be seen
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        body = view(server)
        stream.close()
    (row,) = body["sessions"]
    assert row["where"] == "active" and row["last_used"] is None
    request = row["request"]
    assert request["phase"] in {"decoding", "batched"}
    assert request["prompt_tokens"] == len(codec.encode_chat(messages))
    assert request["cached_tokens"] == 0 and request["reuse_reason"] == "no_history"
    assert request["generated_tokens"] >= 1 and request["batch_size"] == 1
    assert row["tokens"] >= request["prompt_tokens"]
    assert body["engine"]["active_rows"] == 1 and body["disk"] is None
    assert_private(body, [codec.encode_chat(messages)], [ALICE])


def test_an_eviction_is_counted_and_its_conversation_leaves(
    install: Path, codec: TextCodec
) -> None:
    """Two slots, three conversations: the third evicts the least recently used."""
    conversations = [[{"role": "user", "content": text}] for text in (ALICE, BOB, ALICE_MORE)]
    with serving(install, codec, slots=2) as server:
        chat(server, conversations[0])
        first = {s["conversation"] for s in view(server)["sessions"]}
        chat(server, conversations[1])
        before = view(server)
        chat(server, conversations[2])
        after = view(server)
    assert before["pool"]["evictions"] == 0 and len(before["sessions"]) == 2
    assert after["pool"]["evictions"] == 1
    remaining = {s["conversation"] for s in after["sessions"]}
    assert len(remaining) == 2 and not first & remaining  # Alice's number is gone


def test_the_page_is_one_self_contained_file(install: Path, codec: TextCodec) -> None:
    with serving(install, codec, slots=2) as server:
        page = httpx.get(f"{server.base_url}/")
        schema = httpx.get(f"{server.base_url}/openapi.json").json()
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    # Nothing from elsewhere: no absolute URL, no external script, style or font.
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", page.text, re.I)
    assert not re.search(r"<script[^>]+src=|<link[^>]+stylesheet|@import|url\(", page.text, re.I)
    # The page reads the fields the API promises.
    for field in ("cached_tokens", "reuse_reason", "reuse_detail", "batch_size", "empty_slots"):
        assert field in page.text
    documented = schema["paths"]["/turbospark/sessions"]["get"]["responses"]["200"]
    assert documented["content"]["application/json"]["schema"]["$ref"].endswith("/SessionsView")
