"""A server takes requests while it warms up: ``/health`` says ``warming``, a
request that arrives then cuts the warm-up short instead of waiting for all of
it, and its reply is the one the same request gets once the server is warm
(and from a fresh runner)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving import client, serving

from turbospark.generation.engine import Engine
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.text import load_text

MESSAGES = [{"role": "user", "content": "Tell me about lighthouses."}]
MAX_BATCH = 4


def health(base: str) -> dict:
    return httpx.get(f"{base}/health").json()


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_a_request_during_the_warm_up_is_answered_as_after_it(family, request, monkeypatch, caplog):
    install: Path = request.getfixturevalue(f"{family}_install")
    codec = load_text(install)
    opened = threading.Event()  # the warm-up's steps wait for it: the request comes first
    real_step = Engine.step

    def step(engine: Engine) -> bool:
        if engine.warming:
            assert opened.wait(30), "the test never let the warm-up go on"
        return real_step(engine)

    monkeypatch.setattr(Engine, "step", step)
    caplog.set_level(logging.INFO, logger="turbospark.generation.engine")
    with serving(install, codec, 2, warm_up=[0] * 40, max_batch=MAX_BATCH, model_id="m") as server:
        assert health(server.base_url)["status"] == "warming"
        api = client(server)
        replies: list[str] = []

        def ask() -> None:
            stream = api.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=10, temperature=0, stream=True
            )
            replies.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

        asking = threading.Thread(target=ask)
        asking.start()
        engine = server.service.engine
        deadline = time.monotonic() + 30
        while not engine._request_waits():  # queued behind the warm-up's first round
            assert asking.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        opened.set()
        asking.join(30)
        assert replies and "warm-up cut short" in caplog.text
        assert health(server.base_url)["status"] == "ok"
        ask()  # the server is warm now (the first reply's session is reused, to the same end)
    alone = generate(
        Runner.open(install, context_length=2048),
        codec,
        codec.encode_chat(MESSAGES),
        GenerationConfig(max_tokens=10, temperature=0.0),
    )
    assert replies[0] == replies[1] == alone.text != ""
