"""Chaos on loopback against real ``turbospark serve`` processes: SIGKILL while
replies stream, session files swapped and rolled back while the server is down,
a client that stops reading, SIGTERM with that client still attached, and
refusals at start. Every reply after a fault is compared, token by token with
its logprobs, with a reference server that reuses nothing. Each wait is bounded;
traffic stays on 127.0.0.1."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import httpx2
import openai
import pytest
from serving import assert_same_reply, greedy_reply, reference, serve_process

from turbospark.sessions.session_file import SUFFIX
from turbospark.text import TextCodec

pytestmark = pytest.mark.slow

MODEL = "tiny-chaos"
SHUTDOWN_BOUND_S = 10.0  # docs/RELIABILITY.md: SIGTERM ends the process within this


def api(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def live_file(base: str) -> str:
    """The file of the session the last request left live."""
    view = httpx.get(f"{base}/turbospark/sessions", timeout=10).json()
    (live,) = [s for s in view["sessions"] if s["where"] == "live"]
    return live["file"]


def stream_until_killed(
    base: str, messages: list[dict[str, str]], started: threading.Event
) -> None:
    """Stream a long reply; the server dies under it, which is the point."""
    try:
        events = api(base).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2000, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for _ in events:
            started.set()
    except (openai.APIError, httpx.HTTPError, httpx2.HTTPError):  # httpx2: the SDK's transport
        pass
    finally:
        started.set()


def stalled_reader(base: str) -> socket.socket:
    """A streamed reply of megabytes (4 choices, 20 logprobs a token) on a
    connection whose small receive buffer is never read."""
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({
        "model": MODEL, "prompt": "tell me everything", "max_tokens": 2000, "n": 4,
        "temperature": 0, "ignore_eos": True, "logprobs": 20, "stream": True,
    }).encode()  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    return sock


def test_the_server_survives_kills_swapped_files_and_stalled_clients(
    install: Path, codec: TextCodec, tmp_path: Path
) -> None:
    directory = tmp_path / "sessions"
    flags = ["--session-slots", "2", "--session-dir", str(directory), "--send-timeout", "30"]
    openings = [
        "Plan a walk along the coast.",
        "Which tea goes with cake?",
        "Name rivers in Spain.",
    ]
    chats = [[{"role": "user", "content": text}] for text in openings]
    files: list[str] = []
    with serve_process(install, *flags) as (process, base):
        for chat in chats:
            for follow_up in ("Tell me more.", "And then?"):
                done = greedy_reply(api(base), MODEL, chat)
                chat += [{"role": "assistant", "content": "".join(done[0])}]
                if chat is chats[0] and follow_up == "Tell me more.":  # A's first state
                    shutil.copy(directory / f"{live_file(base)}{SUFFIX}", tmp_path / "older")
                chat.append({"role": "user", "content": follow_up})
            files.append(live_file(base))
        # SIGKILL while all three stream their next reply.
        started = [threading.Event() for _ in chats]
        streams = [
            threading.Thread(target=stream_until_killed, args=(base, chat, flag))
            for chat, flag in zip(chats, started, strict=True)
        ]
        for thread in streams:
            thread.start()
        for flag in started:
            assert flag.wait(60)
        process.send_signal(signal.SIGKILL)
        process.wait()
        for thread in streams:
            thread.join(60)

    # While the server is down: C's file becomes B's, A's rolls back to its first turn.
    shutil.copy(directory / f"{files[1]}{SUFFIX}", directory / f"{files[2]}{SUFFIX}")
    shutil.copy(tmp_path / "older", directory / f"{files[0]}{SUFFIX}")

    replies = []
    with serve_process(install, *flags) as (process, base):
        stalled = stalled_reader(base)
        replies = [greedy_reply(api(base), MODEL, chat) for chat in chats]
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["status"] == "ok"
        # SIGTERM with the stalled client still attached: the process ends in bounded time.
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=SHUTDOWN_BOUND_S + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve did not end within {SHUTDOWN_BOUND_S + 20} s of SIGTERM")
        took = time.monotonic() - began
        stalled.close()
        assert took < SHUTDOWN_BOUND_S, (took, output[-2000:])
        assert "Traceback" not in output, output[-4000:]

    for chat, done in zip(chats, replies, strict=True):
        chat += [{"role": "assistant", "content": "".join(done[0])}]
        chat.append({"role": "user", "content": "Thanks."})
    with serve_process(install, *flags) as (process, base):
        after_restart = [greedy_reply(api(base), MODEL, chat) for chat in chats]
        assert after_restart[0][2]["reuse_reason"] == "restored_from_disk", after_restart[0][2]

    with reference(install, codec) as ref:
        for chat, ours, later in zip(chats, replies, after_restart, strict=True):
            earlier = chat[:-2]
            # The reference answers the earlier turns itself first: only the server
            # that generated a re-sent reply feeds it as its generated ids.
            for i, message in enumerate(earlier):
                if message["role"] == "assistant":
                    greedy_reply(api(ref.base_url), MODEL, earlier[:i])
            assert_same_reply(ours, greedy_reply(api(ref.base_url), MODEL, earlier))
            assert_same_reply(later, greedy_reply(api(ref.base_url), MODEL, chat))
    assert not list(directory.glob(".tmp-*"))


@pytest.mark.parametrize("case", ["locked", "not a directory"])
def test_startup_refusals_exit_2_every_time(install: Path, tmp_path: Path, case: str) -> None:
    """One line on stderr and exit status 2, never an abort (it was 134 in about
    half the runs: MLX's thread destructors under a finalizing interpreter)."""
    directory = tmp_path / "sessions"
    if case == "locked":  # another server holds it
        directory.mkdir()
        holder = (directory / ".lock").open("a")
        fcntl.lockf(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        named, runs = "another process is using", 6
    else:
        directory.write_text("a file where the directory should be")
        named, runs = "cannot use", 2
    command = [sys.executable, "-m", "turbospark", "serve", str(install), "--session-slots", "2",
               "--session-dir", str(directory), "--port", "0"]  # fmt: skip
    for _ in range(runs):
        done = subprocess.run(
            command, env={**os.environ, "TURBOSPARK_PLUGINS": "gemma4"}, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and named in done.stderr, done.stderr
