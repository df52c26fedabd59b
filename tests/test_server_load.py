"""A bounded load and fault run on loopback: 32 concurrent clients, faults mixed in.

The suite sends ``TURBOSPARK_LOAD_REQUESTS`` requests (default 64); the
figures in docs/RELIABILITY.md come from the full run::

    TURBOSPARK_LOAD_REQUESTS=500 uv run pytest tests/test_server_load.py -s

Kinds, drawn with a fixed seed: normal temperature-0 requests (streamed or
not, chat or completion), streams the client abandons after a few events,
bodies over ``--max-request-bytes``, and malformed bodies. Afterwards every
normal reply must equal the same request sent alone, every refusal must be
the expected 4xx, and the server must hold what it held before: its
sessions' count and bytes, no queue places, and MLX's active memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from serving import service, serving

from turbospark import build_synthetic_install
from turbospark.server.settings import ServerLimits
from turbospark.text import load_text

MODEL = "tiny-load"
CLIENTS = 32
REQUESTS = int(os.environ.get("TURBOSPARK_LOAD_REQUESTS", "64"))
LIMITS = ServerLimits(max_request_bytes=256 * 1024, max_queue=64)
PROMPTS = [f"Conversation {i}: tell me about {topic}." for i, topic in
           enumerate(["rivers", "bread", "owls", "trains", "tides", "maps", "bees", "salt"])]  # fmt: skip
MALFORMED = [
    b'{"model": "tiny-load", "prompt": "\\ud800"}',
    b'{"model": "tiny-load", "messages": [{"role": "robot", "content": "x"}]}',
    b'{"model": "tiny-load", "prompt": "x", "temperature": NaN}',
    b'{"model": "tiny-load", "prompt": "x", "seed": -5}',
    b'{"model": "tiny-load", "prompt": ',
    b"\xff\xfe",
]


def plan(count: int) -> list[tuple[str, int]]:
    rng = random.Random(21)
    kinds = rng.choices(
        ["normal", "disconnect", "oversize", "malformed"], [70, 10, 10, 10], k=count
    )
    return [(kind, rng.randrange(1 << 30)) for kind in kinds]


def normal_body(choice: int) -> tuple[str, dict[str, object]]:
    prompt = PROMPTS[choice % len(PROMPTS)]
    fields = {"model": MODEL, "max_tokens": 4 + choice % 5, "temperature": 0,
              "stream": bool(choice & 8)}  # fmt: skip
    if choice & 16:
        return "/v1/chat/completions", {**fields, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**fields, "prompt": prompt}


async def read_reply(response: httpx.Response, stream: bool, chat: bool) -> str:
    if not stream:
        await response.aread()
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    parts = []
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                parts.append((choice["delta"].get("content") if chat else choice["text"]) or "")
    return "".join(parts)


async def one(http: httpx.AsyncClient, kind: str, choice: int) -> tuple[str, object]:
    """(outcome, detail): a normal request's (path, body, reply), else its status."""
    if kind == "normal":
        path, body = normal_body(choice)
        async with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200, await response.aread()
            reply = await read_reply(response, bool(body["stream"]), "messages" in body)
        return "completed", (path, json.dumps(body), reply)
    if kind == "disconnect":
        body = {"model": MODEL, "prompt": PROMPTS[choice % len(PROMPTS)], "max_tokens": 500,
                "stream": True, "temperature": 0}  # fmt: skip
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            for _ in range(1 + choice % 3):
                await anext(lines)
        return "cancelled", None  # leaving the block closes the connection mid-stream
    if kind == "oversize":
        body = json.dumps(
            {"model": MODEL, "prompt": "a" * (LIMITS.max_request_bytes + choice % 999)}
        )
        try:
            response = await http.post("/v1/completions", content=body)
        except httpx.TransportError:
            return "refused-413", None  # closed before the client read the 413
        assert response.status_code == 413, response.text
        return "refused-413", None
    response = await http.post("/v1/completions", content=MALFORMED[choice % len(MALFORMED)])
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["message"]
    return f"refused-{response.status_code}", None


async def load(base_url: str, work: list[tuple[str, int]]) -> tuple[list, list[float]]:
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    results: list[tuple[str, object]] = []
    latencies: list[float] = []

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            while not queue.empty():
                kind, choice = queue.get_nowait()
                started = time.perf_counter()
                outcome = await one(http, kind, choice)
                if outcome[0] == "completed":
                    latencies.append(time.perf_counter() - started)
                results.append(outcome)

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return results, latencies


# Many clients against a real server: the full suite, not the inner loop.
@pytest.mark.slow
def test_load_with_faults_loses_nothing(tmp_path: Path) -> None:
    build_synthetic_install(
        "gemma4", tmp_path, vocab_size=128, num_layers=2, sliding_window=8, model_id=MODEL
    )
    codec = load_text(tmp_path)
    with serving(tmp_path, codec, slots=4, limits=LIMITS) as running:
        svc = service(running)
        alone: dict[tuple[str, str], str] = {}

        def sent_alone(path: str, body: str) -> str:
            """The same request on an otherwise idle server (remembered per body)."""
            if (path, body) not in alone:
                request = {**json.loads(body), "stream": False}
                reply = httpx.post(f"{running.base_url}{path}", json=request).json()["choices"][0]
                alone[(path, body)] = (
                    reply["message"]["content"] if "messages" in request else reply["text"]
                )
            return alone[(path, body)]

        for choice in range(32):  # warm every prompt shape once
            sent_alone(*(lambda p, b: (p, json.dumps(b)))(*normal_body(choice)))
        before = (svc.engine.call(svc.runner.session_nbytes).result(), mx.get_active_memory())

        started = time.perf_counter()
        results, latencies = asyncio.run(load(running.base_url, plan(REQUESTS)))
        wall = time.perf_counter() - started

        outcomes = Counter(outcome for outcome, _ in results)
        assert sum(outcomes.values()) == REQUESTS
        for outcome, detail in results:
            if outcome == "completed":
                path, body, reply = detail  # type: ignore[misc]
                assert reply == sent_alone(path, body), (path, body)
        assert svc.admission.active == 0
        rows = svc.engine.call(lambda: (svc.engine.active_rows, svc.engine.queue_depth)).result()
        assert rows == (0, 0), "a batch row or queued request leaked"
        nbytes = svc.engine.call(svc.runner.session_nbytes).result()
        assert len(nbytes) == len(before[0]) == 4  # no session leaked or lost
        memory = mx.get_active_memory()
        margin = 1 << 20
        assert abs(sum(nbytes) - sum(before[0])) <= margin
        assert memory <= before[1] + margin, (memory, before[1])

    latencies.sort()
    print(
        f"\nload: {REQUESTS} requests from {CLIENTS} clients in {wall:.1f} s; {dict(outcomes)}; "
        f"completed latency p50 {latencies[len(latencies) // 2] * 1e3:.0f} ms, "
        f"p99 {latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3:.0f} ms; "
        f"session bytes {sum(before[0])} -> {sum(nbytes)}, "
        f"MLX active memory {before[1]} -> {memory}"
    )
