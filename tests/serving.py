"""A real server on loopback for the server tests: a synthetic install, served
as ``turbospark serve`` serves it, driven by real clients."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from turbospark.generation.runner import Runner
from turbospark.loading.plugins import FamilyRegistry
from turbospark.policies import DraftPolicies, ExpertCacheSlots
from turbospark.server import ThreadedServer, create_app
from turbospark.server.service import Service
from turbospark.server.settings import ServerLimits
from turbospark.server.worker import RunnerWorker
from turbospark.state.components import state_position
from turbospark.text import TextCodec

CONTEXT = 2048


@contextmanager
def serving(
    install: Path,
    codec: TextCodec,
    slots: int,
    *,
    context: int = CONTEXT,
    limits: ServerLimits | None = None,
    registry: FamilyRegistry | None = None,
    draft: DraftPolicies | None = None,
    expert_cache: ExpertCacheSlots | None = None,
    reuse: bool = True,
    **options: Any,
) -> Iterator[ThreadedServer]:
    """A fresh runner served as ``turbospark serve`` does: opened on the worker thread
    (from *registry*'s families when given), prefix reuse on unless *reuse* is
    false. *options* go to ``create_app`` (``api_key``, ``cors_origins``, ...)."""
    worker = RunnerWorker()

    def open_runner() -> Runner:
        runner = Runner.open(
            install,
            context_length=context,
            session_slots=slots,
            registry=registry,
            draft=draft,
            expert_cache=expert_cache,
        )
        runner.set_prefix_reuse(reuse)
        return runner

    app = create_app(worker.run(open_runner), codec, worker=worker, limits=limits, **options)
    with ThreadedServer(app, limits=limits) as server:
        server.service = app.state.service  # type: ignore[attr-defined]
        server.app = app  # type: ignore[attr-defined]
        yield server


def service(server: ThreadedServer) -> Service:
    return server.service  # type: ignore[attr-defined]


def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def sessions(server: ThreadedServer) -> list[tuple[int, int, int]]:
    """Every session (live first, then parked) as (identity, position, bytes),
    read on the runner thread after the requests before it: a refused request
    must leave this unchanged."""
    runner = service(server).runner

    def read() -> list[tuple[int, int, int]]:
        states = runner.session_states()
        return [
            (id(s), state_position(s), n)
            for s, n in zip(states, runner.session_nbytes(), strict=True)
        ]

    return service(server).engine.call(read).result()


@contextmanager
def serving_with_disk(
    install: Path,
    codec: TextCodec,
    directory: Path,
    slots: int,
    max_session_disk_bytes: int | None = None,
) -> Iterator[ThreadedServer]:
    """``turbospark serve --session-slots N --session-dir DIR [--max-session-disk
    SIZE]``, as :func:`serving`."""
    worker = RunnerWorker()

    def open_runner() -> Runner:
        runner = Runner.open(
            install,
            context_length=CONTEXT,
            session_slots=slots,
            session_dir=directory,
            max_session_disk_bytes=max_session_disk_bytes,
        )
        runner.set_prefix_reuse(True)
        return runner

    app = create_app(worker.run(open_runner), codec, worker=worker)
    with ThreadedServer(app) as server:
        server.service = app.state.service  # type: ignore[attr-defined]
        yield server


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serve_process(
    install: Path, *flags: str, family: str = "gemma4"
) -> Iterator[tuple[subprocess.Popen, str]]:
    """``turbospark serve INSTALL FLAGS`` as its own process, output piped; yields
    it and its base URL once /health answers, and kills it if it is still running."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "turbospark", "serve", str(install), "--port", str(port), *flags],
        env={**os.environ, "TURBOSPARK_PLUGINS": family},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # a readiness wait, not a measurement
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"serve exited: {process.stdout.read()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("serve did not come up")
            time.sleep(0.1)
        yield process, base
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def forced_call(api: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str, str]:
    """The (name, arguments) of a tool call forced through the chat API: named
    when not streaming, ``required`` when streaming; the finish reason checked."""
    if not stream:
        choice = {"type": "function", "function": {"name": "get_weather"}}
        reply = api.chat.completions.create(**kwargs, tool_choice=choice)
        assert reply.choices[0].finish_reason == "tool_calls", reply
        call = reply.choices[0].message.tool_calls[0]
        return call.function.name, call.function.arguments
    events = list(api.chat.completions.create(**kwargs, tool_choice="required", stream=True))
    deltas = [c for e in events for c in e.choices]
    calls = [t for c in deltas for t in c.delta.tool_calls or []]
    assert deltas[-1].finish_reason == "tool_calls"
    return calls[0].function.name, calls[0].function.arguments


# The tool the tool-calling tests call, with a schema a forced call must satisfy.
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@contextmanager
def reference(install: Path, codec: TextCodec) -> Iterator[ThreadedServer]:
    """The server replies are compared against under faults: one slot, no prefix
    reuse (``--session-slots 1 --no-prefix-reuse``)."""
    with serving(install, codec, slots=1) as running:
        service(running).runner.set_prefix_reuse(False)
        yield running


Reply = tuple[list[str], list[float], dict]


def greedy_reply(api: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> Reply:
    """One greedy chat turn of 6 tokens: its tokens, their logprobs (random-weight
    text hides differences they show), and usage's turbospark extension."""
    done = api.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True
    )
    content = done.choices[0].logprobs.content
    usage = done.usage.model_extra["turbospark"]
    return [t.token for t in content], [t.logprob for t in content], usage


def assert_same_reply(ours: Reply, theirs: Reply) -> None:
    assert ours[0] == theirs[0]
    assert ours[1] == pytest.approx(theirs[1], abs=1e-4)
