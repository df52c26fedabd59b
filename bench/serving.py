"""The interleaved chat workload over HTTP: ``turbospark serve`` against ``mlx_lm.server``.

Both servers run as subprocesses on loopback, serve the same install
directory (an HF checkpoint with a tokenizer and chat template, which
mlx-lm loads unchanged), inherit the same environment (so the same BLAS),
and receive the same streamed chat requests one at a time: ours with
``--session-slots K``, mlx-lm's with its LRU prompt cache (10 entries by
default, more than K). Each is warmed up with one unrelated request, then
killed at the end.

Time to first token is measured at the client: from sending the request to
the first SSE event that carries a token (content or a finish reason), so it
includes tokenising, templating, reuse and prefill. Prefill tokens computed
come from each server's own ``usage`` (``prompt_tokens - cached_tokens``).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.workload import ChatWorkload

ROOT = Path(__file__).resolve().parents[1]
MODEL = "default_model"  # mlx-lm's name for its --model; ours is told to use it too
READY_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(
    kind: str,
    path: Path,
    port: int,
    slots: int,
    extra: Sequence[str] = (),
    cache_limit: str | None = None,
) -> list[str]:
    """The command line of *kind*'s server on loopback, plus *extra* flags of its own;
    with *cache_limit* (a size, ``8GiB``) started through :mod:`bench.capped`, which
    bounds MLX's buffer cache first, the same way for both servers."""
    if kind == "turbospark":
        module, args = "turbospark", [
            "serve", str(path),
            "--session-slots", str(slots), "--port", str(port), "--model-id", MODEL,
            "--context-length", "8192", "--host", "127.0.0.1", *extra,
        ]  # fmt: skip
    else:
        module, args = "mlx_lm.server", [
            "--model", str(path),
            "--port", str(port), "--host", "127.0.0.1", "--log-level", "WARNING", *extra,
        ]  # fmt: skip
    if cache_limit is None:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "bench.capped", "--cache-limit", cache_limit, "-m", module, *args]


def server_env(cache_limit: str | None) -> dict[str, str]:
    """This process's environment (the same BLAS for both servers); through the
    launcher, the repository root first on the path so ``bench.capped`` is found
    from any working directory."""
    env = os.environ.copy()
    if cache_limit is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def accepts(kind: str, base: str) -> bool:
    """Whether the server answers ``/v1/models``: it takes requests from now on."""
    return httpx.get(f"{base}/v1/models", timeout=2.0).status_code == 200


def _ready(kind: str, base: str) -> bool:
    """Whether the server takes requests at full speed: ours answers HTTP while it
    warms up (``/health`` says ``warming``; a request then cuts the warm-up short,
    and the benchmarks that time warm servers wait for it to end)."""
    if not accepts(kind, base):
        return False
    if kind != "turbospark":
        return True
    return httpx.get(f"{base}/health", timeout=2.0).json().get("status") == "ok"


@contextmanager
def launched(
    kind: str,
    path: Path,
    slots: int,
    log: Path,
    extra: Sequence[str] = (),
    cache_limit: str | None = None,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """Start a server on a free port, yield the process and its base URL at once
    (nothing waited for); always kill it."""
    port = _free_port()
    with log.open("w") as sink:
        proc = subprocess.Popen(
            server_command(kind, path, port, slots, extra, cache_limit),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=server_env(cache_limit),
        )
        try:
            yield proc, f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_until(
    kind: str, proc: subprocess.Popen, base: str, log: Path, ready: Callable[[str, str], bool]
) -> None:
    """Poll *ready* every few ms until it holds; refuse a server that exited or
    is not ready after ``READY_TIMEOUT_S``."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited with {proc.returncode}; see {log}")
        try:
            if ready(kind, base):
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{kind} server not ready after {READY_TIMEOUT_S}s; see {log}")
        time.sleep(0.02)


@contextmanager
def running_server(
    kind: str,
    path: Path,
    slots: int,
    log: Path,
    extra: Sequence[str] = (),
    cache_limit: str | None = None,
) -> Iterator[str]:
    """Start a server, wait until it is ready (:func:`_ready`), yield its base URL; always kill it."""
    with launched(kind, path, slots, log, extra, cache_limit) as (proc, base):
        wait_until(kind, proc, base, log, _ready)
        yield base


def warm_up_line(log: Path) -> str | None:
    """Our server's warm-up line from its *log* (the time of each round, or
    where a request cut it short), so a result says where a slow start went;
    None where the log has none (mlx-lm's, or ``--no-warm-up``)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [
        ln.split(": ", 2)[-1] for ln in lines if "warmed up in" in ln or "warm-up cut short" in ln
    ]
    return found[-1] if found else None


# Sent to every server: mlx-lm's tokenizer passes ``enable_thinking`` itself (True
# where the vocabulary has ``<think>``, as the synthetic Qwen one does) and ours
# leaves the template its default, so a Qwen3.5-style template would render other
# ids for each. Thinking is turned off for both, as an operator serving without
# reasoning would; templates without the flag ignore it.
TEMPLATE_KWARGS = {"enable_thinking": False}


def chat_request(
    client: httpx.Client,
    base: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chat completion: time to first token, total time, usage, the reply's text.
    *extra* body fields (``ignore_eos``, ``logit_bias``) go to this server only."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": TEMPLATE_KWARGS,
        **(extra or {}),
    }
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    text: list[str] = []
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue  # SSE comments (mlx-lm's keep-alives) and blank separators
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"server error: {event['error']}")
            for choice in event.get("choices") or []:
                content = choice.get("delta", {}).get("content")
                has_token = content is not None
                text.append(content or "")
                if first is None and (has_token or choice.get("finish_reason")):
                    first = time.perf_counter()
            usage = event.get("usage") or usage
    end = time.perf_counter()
    prompt = int(usage.get("prompt_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {
        "ttft_s": (first or end) - start,
        "request_s": end - start,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "batch_size": (usage.get("turbospark") or {}).get("batch_size"),
        "text": "".join(text),  # the reply as this client received it
    }


def bench_servers(
    path: Path, workload: ChatWorkload, log_dir: Path, cache_limit: str | None = None
) -> dict[str, Any]:
    """Ours and mlx-lm's server on the same requests. Both run side by side and
    take each request in alternating order (one request in flight at a time),
    so load from elsewhere hits both alike; *cache_limit* bounds both MLX buffer
    caches (``mlx_cache_limit`` in the result). ``ttft_ratio`` is theirs ÷ ours,
    the median over turns (> 1: we answer sooner), reported only when both
    servers saw the same prompt tokens on every request (``same_prompt_tokens``);
    otherwise ``ratio_refused`` says where they differed."""
    log_dir.mkdir(parents=True, exist_ok=True)
    kinds = ("turbospark", "mlx_lm")
    turns: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    with ExitStack() as stack:
        bases = {
            kind: stack.enter_context(
                running_server(
                    kind,
                    path,
                    workload.conversations,
                    log_dir / f"{path.name}-{kind}.log",
                    cache_limit=cache_limit,
                )
            )
            for kind in kinds
        }
        client = stack.enter_context(httpx.Client(timeout=300.0))
        for base in bases.values():
            chat_request(
                client, base, [{"role": "user", "content": "warm up"}], workload.max_tokens
            )
        for i, (conv, turn, messages) in enumerate(workload.requests()):
            for kind in kinds if i % 2 == 0 else kinds[::-1]:
                row = chat_request(client, bases[kind], messages, workload.max_tokens)
                turns[kind].append({"conversation": conv, "turn": turn, **row})
    result: dict[str, Any] = {
        kind: {
            "total_s": sum(t["request_s"] for t in rows),
            "prefill_tokens": sum(t["prefill_tokens"] for t in rows),
            "turns": rows,
        }
        for kind, rows in turns.items()
    }
    result["mlx_cache_limit"] = cache_limit
    ours, theirs = turns["turbospark"], turns["mlx_lm"]
    # Both must have tokenised the same chats alike, or the comparison is not like
    # for like: then no ratio is reported, only the turns and why.
    mismatched = [
        (o["conversation"], o["turn"], o["prompt_tokens"], t["prompt_tokens"])
        for o, t in zip(ours, theirs, strict=True)
        if o["prompt_tokens"] != t["prompt_tokens"]
    ]
    result["same_prompt_tokens"] = not mismatched
    if mismatched:
        conv, turn, a, b = mismatched[0]
        result["ratio_refused"] = (
            f"prompt tokens differ on {len(mismatched)} request(s), first conversation {conv} "
            f"turn {turn}: {a} (turbospark) vs {b} (mlx-lm); the servers tokenise differently"
        )
        return result
    ratios = [t["ttft_s"] / o["ttft_s"] for o, t in zip(ours, theirs, strict=True)]
    result["ttft_ratio_vs_mlx_lm_server"] = statistics.median(ratios)
    result["total_ratio_vs_mlx_lm_server"] = (
        result["mlx_lm"]["total_s"] / result["turbospark"]["total_s"]
    )
    return result
