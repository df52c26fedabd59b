"""A real server on loopback for the server tests: a synthetic install, served
as ``turbospark serve`` serves it, driven by real clients."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai

from turbospark.plugins import FamilyRegistry
from turbospark.policies import DraftPolicies, ExpertCacheSlots
from turbospark.runner import Runner
from turbospark.server import ThreadedServer, create_app
from turbospark.server.app import Service
from turbospark.server.settings import ServerLimits
from turbospark.server.worker import RunnerWorker
from turbospark.state import state_position
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
    **options: Any,
) -> Iterator[ThreadedServer]:
    """A fresh runner served as ``turbospark serve`` does: opened on the worker thread
    (from *registry*'s families when given). *options* go to ``create_app``
    (``api_key``, ``cors_origins``, ...)."""
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
        runner.set_prefix_reuse(True)
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
    install: Path, codec: TextCodec, directory: Path, slots: int
) -> Iterator[ThreadedServer]:
    """``turbospark serve --session-slots N --session-dir DIR``, as :func:`serving`."""
    worker = RunnerWorker()

    def open_runner() -> Runner:
        runner = Runner.open(
            install, context_length=CONTEXT, session_slots=slots, session_dir=directory
        )
        runner.set_prefix_reuse(True)
        return runner

    app = create_app(worker.run(open_runner), codec, worker=worker)
    with ThreadedServer(app) as server:
        server.service = app.state.service  # type: ignore[attr-defined]
        yield server


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
