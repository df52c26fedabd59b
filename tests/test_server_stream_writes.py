"""How a streamed reply reaches the socket: a body chunk the transport can take
at once is written by ``GuardedH11.write_chunk`` (h11's chunked framing, no
state machine), every other send by uvicorn; chunks the engine handed over
together go out in one write. Both must be invisible to clients: the bytes on
the wire are the ones uvicorn writes, and the SDK reads the same events."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from serving import client, serving
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from turbospark.generation.request import Chunk, GenerationStats
from turbospark.server import ThreadedServer
from turbospark.server.connections import GuardedH11
from turbospark.server.limits import SendDeadline
from turbospark.text import TextCodec

MODEL = "tiny-stream-writes"
PARTS = [
    "data: one\n\n",
    "",
    "data: \u00fcn\u00efc\u00f6de \u2603\n\n",
    "x" * 70_000,
    "data: end\n\n",
]


async def parts(request: Request) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        for part in PARTS:
            yield part

    return StreamingResponse(body(), media_type="text/event-stream")


def raw(server: ThreadedServer, method: str, version: str) -> bytes:
    """The whole response to one request, as the socket got it, its Date header
    blanked (the only part that may differ between two replies)."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(f"{method} / {version}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return re.sub(rb"(?im)^date: [^\r]*", b"date: -", got)


@pytest.fixture(scope="module")
def plain() -> Iterator[ThreadedServer]:
    """A Starlette app that streams PARTS behind SendDeadline, as the server's are."""
    middleware = [Middleware(SendDeadline, request_timeout=30.0, send_timeout=10.0)]
    app = Starlette(routes=[Route("/", parts, methods=["GET", "HEAD"])], middleware=middleware)
    with ThreadedServer(app) as server:
        yield server


def written_fast(monkeypatch: pytest.MonkeyPatch, fast: bool) -> list[bool]:
    """Record what ``write_chunk`` answered; with *fast* False it declines every
    chunk, so uvicorn's send (and h11) writes them all."""
    answers: list[bool] = []
    real = GuardedH11.write_chunk

    def write_chunk(self: GuardedH11, scope: Any, body: bytes) -> bool:
        answers.append(fast and real(self, scope, body))
        return answers[-1]

    monkeypatch.setattr(GuardedH11, "write_chunk", write_chunk)
    return answers


@pytest.mark.parametrize(
    ("method", "version", "fast"),
    [("GET", "HTTP/1.1", True), ("GET", "HTTP/1.0", False), ("HEAD", "HTTP/1.1", False)],
)
def test_a_streamed_reply_is_the_bytes_uvicorn_writes(
    plain: ThreadedServer, monkeypatch: pytest.MonkeyPatch, method: str, version: str, fast: bool
) -> None:
    """Chunked (HTTP/1.1) replies go the direct way; HTTP/1.0's close-delimited
    body and HEAD's empty one are left to uvicorn. The bytes are the same."""
    by_uvicorn = written_fast(monkeypatch, fast=False)
    expected = raw(plain, method, version)
    monkeypatch.undo()
    answers = written_fast(monkeypatch, fast=True)
    assert raw(plain, method, version) == expected
    assert len(answers) == len(by_uvicorn) == len(PARTS)
    assert any(answers) is fast  # the empty part is always uvicorn's (h11 writes nothing)
    if version == "HTTP/1.1" and method == "GET":
        assert b"transfer-encoding: chunked" in expected.lower()


TEXTS = ["Hel", 'lo "w', "", "\u00f6rld\n", " \u2603", "\\n"]


def stats(generated: int) -> GenerationStats:
    return GenerationStats(
        prompt_tokens=4,
        reused_tokens=0,
        generated_tokens=generated,
        reuse_reason="fresh",
        reuse_detail="",
        swapped=False,
        evicted=False,
        prefill_seconds=0.0,
        decode_seconds=0.0,
    )


def fake_engine(pause: float) -> Callable[[Any], None]:
    """An engine ``submit`` that emits TEXTS then a finished chunk to the job:
    all at once on the loop's thread (``pause`` 0: the loop finds every chunk
    queued, as when it falls behind), or one every *pause* seconds from a thread."""

    def emit_all(job: Any) -> None:
        chunks = [Chunk(text=t, token=5) for t in TEXTS]
        chunks.append(Chunk(text="!", finish_reason="stop", stats=stats(len(TEXTS) + 1)))
        for chunk in chunks:
            job.emit(chunk)
            if pause:
                time.sleep(pause)

    def submit(job: Any) -> None:
        if pause:
            threading.Thread(target=emit_all, args=(job,), daemon=True).start()
        else:
            emit_all(job)

    return submit


def test_chunks_that_arrive_together_reach_the_sdk_as_the_same_events(
    install: Path, codec: TextCodec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's chunks handed over one at a time, and all at once (written
    in one body chunk): the openai SDK reads the same events, in order."""
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen: dict[float, list[Any]] = {}
    writes: dict[float, list[bool]] = {}
    with serving(install, codec, slots=2) as server:
        engine = server.app.state.service.engine  # type: ignore[attr-defined]
        for pause in (0.02, 0.0):
            monkeypatch.setattr(engine, "submit", fake_engine(pause))
            writes[pause] = written_fast(monkeypatch, fast=True)
            events = list(client(server).chat.completions.create(**request))
            seen[pause] = [e.model_dump(exclude={"id", "created"}) for e in events]
            monkeypatch.undo()
    assert seen[0.0] == seen[0.02]
    text = "".join(e["choices"][0]["delta"]["content"] or "" for e in seen[0.0] if e["choices"])
    assert text == "".join(TEXTS) + "!"
    assert seen[0.0][-1]["usage"]["completion_tokens"] == len(TEXTS) + 1
    # Together: one write for the chunks, then the usage event's and [DONE]'s.
    assert len(writes[0.0]) == 3 < len(writes[0.02])
