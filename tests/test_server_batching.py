"""The server under concurrency: batched requests equal lone ones, hung-up clients free their rows."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect

from turbospark import build_synthetic_install
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.server import ThreadedServer, create_app
from turbospark.server.ollama import NdjsonStream
from turbospark.server.service import GIL_SWITCH_INTERVAL_S, EventStream, Service
from turbospark.server.worker import RunnerWorker
from turbospark.text import TextCodec, load_text

MODEL = "tiny-batch"
CONTEXT = 4096


@pytest.fixture(scope="module", params=["gemma4", "qwen_gdn", "qwen4_exp"])
def install(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"batch-{request.param}")
    build_synthetic_install(request.param, path, vocab_size=128, num_layers=4, model_id=MODEL)
    return path


@pytest.fixture(scope="module")
def codec(install: Path) -> TextCodec:
    return load_text(install)


def _slots(install: Path, wanted: int) -> int:
    """qwen4_exp parks nothing (only its kv is swappable): one slot, its live session."""
    return 1 if install.name.startswith("batch-qwen4_exp") else wanted


def _reusing_runner(install: Path, slots: int) -> Runner:
    """The runner a server opens on its worker thread: prefix reuse on."""
    runner = Runner.open(install, context_length=CONTEXT, session_slots=_slots(install, slots))
    runner.set_prefix_reuse(True)
    return runner


def _reusing_app(install: Path, codec: TextCodec, slots: int, **settings: Any) -> Starlette:
    """A server's app over :func:`_reusing_runner`, opened on its worker thread;
    *settings* go to ``create_app``."""
    worker = RunnerWorker()
    return create_app(
        worker.run(lambda: _reusing_runner(install, slots)), codec, worker=worker, **settings
    )


@pytest.fixture(scope="module")
def server(install: Path, codec: TextCodec) -> Iterator[ThreadedServer]:
    app = _reusing_app(install, codec, 4, max_batch=3, warm_up=[0] * 9)
    with ThreadedServer(app) as running:
        yield running


def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def health(server: ThreadedServer) -> dict:
    return httpx.get(f"{server.base_url}/health").json()


def wait_idle(server: ThreadedServer, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while (state := health(server))["active_rows"] or state["queue_depth"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    return state


TOPICS = ["rivers", "glaciers", "orchards", "lighthouses", "violins", "comets"]


def test_concurrent_requests_equal_the_same_requests_alone(server, install, codec):
    api = client(server)

    def ask(topic: str) -> tuple[str, int]:
        reply = api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Tell me about {topic}."}],
            max_tokens=12,
            temperature=0,
        )
        return reply.choices[0].message.content, reply.usage.model_extra["turbospark"]["batch_size"]

    with ThreadPoolExecutor(len(TOPICS)) as pool:
        answers = list(pool.map(ask, TOPICS))
    assert max(batch for _, batch in answers) > 1, "the requests never shared a batch"
    for topic, (text, _) in zip(TOPICS, answers, strict=True):
        ids = codec.encode_chat([{"role": "user", "content": f"Tell me about {topic}."}])
        alone = generate(
            Runner.open(install, context_length=CONTEXT),
            codec,
            ids,
            GenerationConfig(max_tokens=12, temperature=0.0),
        )
        assert text == alone.text, topic
    assert wait_idle(server)["status"] == "ok"


def test_a_streaming_client_that_hangs_up_frees_its_row(server):
    api = client(server)
    stream = api.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    wait_idle(server)
    reply = api.completions.create(model=MODEL, prompt="Still there?", max_tokens=4)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_non_streaming_client_that_hangs_up_frees_its_row(server):
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.5)
    wait_idle(server)


def test_serving_hands_the_gil_back_fast_and_restores_the_interval(install, codec):
    """While the engine serves, Python's switch interval is short (the runner
    thread must not wait 5 ms for the event loop's GIL every step); stopping
    puts the process's own value back."""
    before = sys.getswitchinterval()
    worker = RunnerWorker()
    runner = worker.run(lambda: Runner.open(install, context_length=CONTEXT))
    app = create_app(runner, codec, worker=worker, max_batch=2)
    with ThreadedServer(app):
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == before


def test_a_stream_that_fell_behind_gets_its_queued_chunks_in_one_batch(install, codec):
    """``Service.chunk_batches`` hands over every chunk queued by the time the
    consumer asks (one write for a stream that fell behind the engine), and
    the chunks are the ones the one-at-a-time iterator gives."""
    import asyncio

    from turbospark.server.schemas import ChatCompletionRequest

    service = _reusing_app(install, codec, 2, max_batch=2).state.service
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "about comets"}],
         "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    )  # fmt: skip

    async def main() -> tuple[list, list]:
        draws = (await service.chat_draws(body, service.deadline())).draws
        alone = [pair async for pair in service.chunks(draws, service.deadline())]
        draws = (await service.chat_draws(body, service.deadline())).draws
        batches = []
        async for batch in service.chunk_batches(draws, service.deadline()):
            batches.append(batch)
            await asyncio.sleep(0.3)  # a slow client: the engine runs ahead
        return alone, batches

    service.start(None)
    try:
        alone, batches = asyncio.run(main())
    finally:
        service.stop()
    seen = lambda pairs: [(i, c.token, c.text, c.finish_reason) for i, c in pairs]  # noqa: E731
    assert seen(pair for batch in batches for pair in batch) == seen(alone)
    assert len(alone) == 13 and max(len(batch) for batch in batches) > 1


async def _send_stream(
    service: Service,
    stream_type: type[EventStream],
    send: Callable[[dict[str, Any]], Awaitable[None]],
) -> None:
    """A stream of one event (``"one\\n"``) made as a route makes it (its queue
    place handed over) and served to *send*, with a client that never sends."""

    async def events() -> AsyncGenerator[str, None]:
        yield "one\n"

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    with service.admission.admit() as ticket:
        stream = stream_type(events(), ticket.hand_over())
    await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)


@pytest.mark.parametrize("stream_type", [EventStream, NdjsonStream])
def test_a_stream_whose_client_left_before_its_first_event_takes_back_its_announcement(
    install, codec, stream_type
):
    """A streamed request's generator submits its jobs (and so takes back its
    announcement) on its first event; when the client is gone before that,
    the generator never runs, and the response's end takes the announcement
    back and frees the queue place instead (each stream type the routes use)."""
    service = _reusing_app(install, codec, 2, max_batch=2, gather_s=30.0).state.service

    async def gone(message: dict[str, Any]) -> None:
        raise OSError("the client hung up")

    async def served() -> None:
        service._announce()
        with contextlib.suppress(OSError, ClientDisconnect):
            await _send_stream(service, stream_type, gone)

    asyncio.run(served())
    assert service.engine._coming == set()
    assert service.admission.active == 0


@pytest.mark.parametrize("stream_type", [EventStream, NdjsonStream])
def test_a_stream_sent_whole_ends_cleanly(install, codec, stream_type):
    """A stream sent to its end returns from the ASGI call (no error after its
    last event, whether or not the metrics counter wrapped its route) and frees
    its queue place."""
    service = _reusing_app(install, codec, 2, max_batch=2).state.service
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(_send_stream(service, stream_type, send))
    assert next(m.get("body") for m in sent if m["type"] == "http.response.body") == b"one\n"
    assert service.admission.active == 0


def test_every_request_takes_back_its_announcement(install, codec):
    """A request tells the engine it is coming while its prompt is prepared
    (``Engine.expect``, so that a burst prefills together) and takes that back
    when its jobs are submitted, streamed or not, through the chat and the
    completions routes, or when it is refused (an over-long prompt, a
    ``logit_bias`` outside the vocabulary); counting a prompt's tokens
    announces nothing: none is left to hold later prompts. With gathering at
    30 s, one left behind would hold the next request past the client's 10 s
    timeout."""
    app = _reusing_app(install, codec, 2, max_batch=2, gather_s=30.0)
    engine = app.state.service.engine
    with ThreadedServer(app) as running:
        api = openai.OpenAI(
            base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0, timeout=10
        )
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "comets"}]}
        api.chat.completions.create(**chat, max_tokens=3)
        for _ in api.chat.completions.create(**chat, max_tokens=3, stream=True):
            pass
        api.completions.create(model=MODEL, prompt="Once", max_tokens=3)
        too_long = [{"role": "user", "content": "comet " * CONTEXT}]
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(model=MODEL, messages=too_long, max_tokens=3)
        unknown_id = {str(codec.vocab_size + 7): 1.0}  # refused in its draws, after its prompt
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(**chat, max_tokens=3, logit_bias=unknown_id)
        assert engine._coming == set()
        counter = anthropic.Anthropic(base_url=running.base_url, api_key="unused", max_retries=0)
        counter.messages.count_tokens(model=MODEL, messages=chat["messages"])  # submits nothing
        assert engine._coming == set()
        api.chat.completions.create(**chat, max_tokens=3)
        wait_idle(running)
        assert engine._coming == set()
