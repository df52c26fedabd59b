"""Limits before work: body size, prompt length, queue places, time; each over loopback."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serving import client, service, serving, sessions
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from turbospark.cli import main
from turbospark.server import ThreadedServer
from turbospark.server.prompt_bound import MAX_CANONICAL_DECOMPOSITION, PromptBound
from turbospark.server.settings import ServerLimits
from turbospark.text import TextCodec

MODEL = "tiny-limits"


LIMITS = ServerLimits(max_request_bytes=64 * 1024, header_timeout=0.5)


@pytest.fixture(scope="module")
def server(install: Path, codec: TextCodec) -> Iterator[ThreadedServer]:
    with serving(install, codec, slots=2, limits=LIMITS) as running:
        client(running).completions.create(model=MODEL, prompt="warm", max_tokens=2)
        yield running


def raw_exchange(server: ThreadedServer, head: bytes, body: bytes = b"") -> bytes:
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(head + body)
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        length = int(reply.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(reply.split(b"\r\n\r\n", 1)[1]) < length:
            reply += sock.recv(65536)
        return reply


def test_a_declared_oversize_body_gets_413_before_it_is_sent(server: ThreadedServer) -> None:
    """Only the headers go out: the 413 arrives without the server waiting for 1 GiB."""
    before = sessions(server)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1073741824\r\n\r\n"
    )
    reply = raw_exchange(server, head)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    assert b"request_too_large" in reply and b"--max-request-bytes" in reply
    assert sessions(server) == before


def test_a_chunked_upload_is_counted_and_cut_at_the_limit(server: ThreadedServer) -> None:
    """Two 64 KiB chunks of a body that never ends: the 413 comes anyway."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
    reply = raw_exchange(server, head, chunk * 2)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(
    server: ThreadedServer, codec: TextCodec, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    monkeypatch.setattr(codec, "encode", lambda *a, **k: calls.append(1) or [])
    bound = service(server).bound
    chars = bound.chars_per_token * service(server).runner.context_length + 1
    for path, body in [
        ("/v1/completions", {"model": MODEL, "prompt": "a" * chars}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a" * chars}]}),
    ]:  # fmt: skip
        response = httpx.post(f"{server.base_url}{path}", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert calls == []


def test_tokenizing_a_long_prompt_does_not_stall_other_requests(
    server: ThreadedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no character bound, a long prompt is tokenized (a second or more);
    meanwhile /health keeps answering: tokenizing is off the event loop and
    does not hold the GIL."""
    monkeypatch.setattr(service(server), "bound", PromptBound(None, "disabled by the test"))
    big = json.dumps({"model": MODEL, "prompt": "a" * 2_000_000})
    limits = ServerLimits(max_request_bytes=4 << 20)
    monkeypatch.setattr(service(server), "limits", limits)
    result: dict[str, object] = {}
    answered = threading.Event()  # the long prompt's reply came back

    def send() -> None:
        response = httpx.post(f"{server.base_url}/v1/completions", content=big, timeout=60)
        result["code"] = response.json()["error"]["code"]
        answered.set()

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.2)
    while_pending = 0  # /health replies that came back before the prompt's reply
    while sender.is_alive():
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        while_pending += not answered.is_set()
        time.sleep(0.02)
    sender.join()
    assert result["code"] == "context_length_exceeded"
    # Blocked, the first /health would wait for the whole tokenization and come
    # back with the prompt's reply, at most once before it; here they keep coming.
    assert while_pending >= 3, while_pending


@contextmanager
def runner_held(server: ThreadedServer) -> Iterator[None]:
    """Keep the runner thread busy until the block ends (requests queue behind it)."""
    gate = threading.Event()
    holder = threading.Thread(target=lambda: service(server).engine.call(gate.wait).result())
    holder.start()
    try:
        yield
    finally:
        gate.set()
        holder.join()


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_a_full_queue_answers_503_with_retry_after(install: Path, codec: TextCodec) -> None:
    with serving(install, codec, slots=2, limits=ServerLimits(max_queue=1)) as running:
        url = f"{running.base_url}/v1/completions"
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
        client(running).completions.create(**body)
        before = sessions(running)
        admitted: list[httpx.Response] = []
        with runner_held(running):
            waiting = threading.Thread(target=lambda: admitted.append(httpx.post(url, json=body)))
            waiting.start()
            wait_for(lambda: service(running).admission.active == 1)
            refused = httpx.post(url, json={**body, "prompt": "another"})
            assert refused.status_code == 503
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert (error["code"], error["type"]) == ("queue_full", "server_error")
            assert "--max-queue 1" in error["message"]
        waiting.join()
        assert admitted[0].status_code == 200
        assert sessions(running) == before  # only the admitted, identical prompt ran
        assert service(running).admission.active == 0


def test_the_request_timeout_ends_a_request_and_its_generation(
    install: Path, codec: TextCodec
) -> None:
    # 1 s: room for a 2-token request on a loaded CI machine, far short of 8000 tokens
    # (an idle 2-core machine decodes this install's 2000 in about 1.1 s: too close).
    limits = ServerLimits(request_timeout=1.0)
    with serving(install, codec, slots=2, context=8192, limits=limits) as running:
        url = f"{running.base_url}/v1/completions"
        body = {
            "model": MODEL,
            "prompt": "tell me everything",
            "max_tokens": 8000,
            "temperature": 0,
            "ignore_eos": True,  # no early stop can beat the deadline
        }
        whole = httpx.post(url, json=body, timeout=30)
        assert whole.status_code == 504
        assert whole.json()["error"]["code"] == "request_timeout"
        assert "--request-timeout" in whole.json()["error"]["message"]
        streamed = httpx.post(url, json={**body, "stream": True}, timeout=30)
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert "request_timeout" in events[-2] and events[-1] == "data: [DONE]"
        # The runner stopped both generations at their next step: the rows leave,
        # and no session ran on towards 8000 tokens.
        engine = service(running).engine
        wait_for(lambda: engine.call(lambda: engine.active_rows + engine.queue_depth).result() == 0)
        assert max(position for _, position, _ in sessions(running)) < 8000
        assert httpx.post(url, json={**body, "max_tokens": 2}, timeout=30).status_code == 200
        # A request whose deadline passes while it waits for the runner never starts.
        before = sessions(running)
        with runner_held(running):
            queued = httpx.post(url, json={**body, "prompt": "a new conversation"}, timeout=30)
            assert queued.status_code == 504
        assert sessions(running) == before
        assert service(running).admission.active == 0


def test_a_client_that_never_finishes_its_headers_is_disconnected(server: ThreadedServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.perf_counter()
        for _ in range(20):  # a header line every 0.1 s would keep uvicorn waiting forever
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                    break
            except BlockingIOError:
                time.sleep(0.1)
            except OSError:
                break
        closed_after = time.perf_counter() - started
    assert closed_after < LIMITS.header_timeout + 0.5


# -- the character bound is sound -----------------------------------------------------


def test_the_longest_canonical_decomposition_is_four_characters() -> None:
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000))
    assert longest == MAX_CANONICAL_DECOMPOSITION


def byte_level_nfc() -> Tokenizer:
    """A GPT-2-style byte-level BPE with NFC in front, as Qwen ships."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_no_text_encodes_to_fewer_tokens_than_the_bound(codec: TextCodec, text: str) -> None:
    for tokenizer in (codec.tokenizer, byte_level_nfc()):
        bound = PromptBound.of(tokenizer)
        assert bound.chars_per_token is not None, bound.why
        assert len(tokenizer.encode(text).ids) >= bound.min_tokens(len(text))


def test_tokenizers_that_drop_characters_get_no_bound() -> None:
    whitespace = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()
    stripping = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    stripping.normalizer = normalizers.Strip()
    for tokenizer in (whitespace, stripping):
        bound = PromptBound.of(tokenizer)
        assert bound.chars_per_token is None and bound.min_tokens(10**6) == 0
    assert math.ceil(100 / 15) == PromptBound(15, "").min_tokens(100)


@pytest.mark.parametrize("flag", ["--max-request-bytes", "--max-queue", "--request-timeout"])
def test_serve_refuses_a_limit_that_is_not_positive(
    install: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(install), flag, "0"]) == 2
    assert f"{flag} must be positive" in capsys.readouterr().err
