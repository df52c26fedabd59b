"""Faults a server must survive on loopback, each on the server's own code path:
a client that stops reading, session files replaced behind the server's back,
a disk bound that must drop the right files (and say so), a disk that fails,
and a crowd of idle connections. Replies are compared token by token, with
their logprobs (random-weight text hides differences), against a reference
server that reuses nothing (``--session-slots 1 --no-prefix-reuse``)."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from serving import (
    Reply,
    assert_same_reply,
    client,
    greedy_reply,
    reference,
    service,
    serving,
    serving_with_disk,
)

from turbospark.server import ThreadedServer
from turbospark.server.connections import GuardedH11
from turbospark.server.settings import ServerLimits
from turbospark.sessions.session_file import SUFFIX
from turbospark.text import TextCodec

MODEL = "tiny-faults"
# A reply with 20 logprobs a token: hundreds of kilobytes, more than the small
# socket buffers of stalled_request hold.
FLOOD = {
    "model": MODEL,
    "prompt": "tell me everything",
    "max_tokens": 400,
    "n": 2,
    "temperature": 0,
    "ignore_eos": True,
    "logprobs": 20,
}


def reply(server: ThreadedServer, messages: list[dict[str, str]]) -> Reply:
    return greedy_reply(client(server), MODEL, messages)


def replayed(server: ThreadedServer, messages: list[dict[str, str]]) -> Reply:
    """The reference's reply to *messages* after it answered each earlier turn
    itself: a re-sent reply is fed as its generated ids only by the server that
    generated it (SEMANTICS.md), so the reference builds the prompt ours did."""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            reply(server, messages[:i])
    return reply(server, messages)


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    """Poll *condition* until it holds or *seconds* pass (a bound, not a measurement)."""
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def on_runner(server: ThreadedServer, fn: Callable):
    return service(server).engine.call(fn).result()


# -- a client that stops reading ------------------------------------------------------


def stalled_request(server: ThreadedServer, body: dict) -> tuple[socket.socket, tuple]:
    """Send *body* on a connection that is then never read, its buffers small at
    both ends (a slow network: loopback's would absorb megabytes first)."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((server.host, server.port))
    key = ((server.host, server.port), sock.getsockname())
    assert wait_for(lambda: key in GuardedH11._open, 10)
    server_end = GuardedH11._open[key].transport.get_extra_info("socket")
    server_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(data)
    )
    sock.sendall(head + data)
    return sock, key


def drain(sock: socket.socket) -> bytes:
    """Everything the server left for *sock*, until it closed the connection."""
    sock.settimeout(10)
    got = b""
    try:
        while chunk := sock.recv(1 << 20):
            got += chunk
    except ConnectionResetError:
        pass
    return got


@pytest.mark.parametrize(
    "stream, limits",
    [
        (True, ServerLimits(max_queue=1, send_timeout=1.0)),
        (True, ServerLimits(max_queue=1, request_timeout=3.0)),
        (False, ServerLimits(max_queue=1, send_timeout=1.0)),
    ],
    ids=["stream-send-timeout", "stream-request-timeout", "whole-send-timeout"],
)
def test_a_client_that_stops_reading_loses_its_place(
    install: Path, codec: TextCodec, stream: bool, limits: ServerLimits
) -> None:
    """The reply is abandoned (the connection aborted, the reply cut short), the
    generation stops, the queue place is given back, and the session is what an
    uninterrupted server would have: the next turn equals the reference's."""
    with serving(install, codec, slots=2, context=8192, limits=limits) as running:
        stalled, key = stalled_request(running, {**FLOOD, "stream": stream})
        held = service(running)
        # Bounds well past the timeouts above; the old server held both forever.
        assert wait_for(lambda: key not in GuardedH11._open, 30), "the connection is still open"
        assert wait_for(lambda: held.admission.active == 0 and held.engine.active_rows == 0, 10)
        got = drain(stalled)
        stalled.close()
        if stream:
            assert b"data: [DONE]" not in got
        else:
            head, _, body = got.partition(b"\r\n\r\n")
            assert int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]) > len(body)
        messages = [{"role": "user", "content": "tell me everything"}]
        ours = reply(running, messages)
    with reference(install, codec) as ref:
        assert_same_reply(ours, reply(ref, messages))


def test_idle_connections_do_not_lock_out_real_clients(install: Path, codec: TextCodec) -> None:
    """A crowd of connections that send nothing (more than the connection limit)
    gets the idle ones closed, oldest first: a real client is served at once,
    and a request already in flight is never cut."""
    limits = ServerLimits(max_connections=32)
    with serving(install, codec, slots=2, limits=limits) as running:
        url = f"{running.base_url}/v1/completions"
        body = {"model": MODEL, "prompt": "count", "max_tokens": 200, "ignore_eos": True}
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", url, json={**body, "stream": True}) as streaming,
        ):
            lines = streaming.iter_lines()
            assert next(lines).startswith("data: ")
            crowd = [socket.create_connection((running.host, running.port)) for _ in range(40)]
            try:
                for _ in range(3):
                    assert (
                        httpx.post(url, json={**body, "max_tokens": 2}, timeout=30).status_code
                        == 200
                    )
                assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
            finally:
                for sock in crowd:
                    sock.close()


# -- session files replaced behind the server's back ------------------------------------


def disk_files(server: ThreadedServer) -> tuple[dict[str, int], set[str]]:
    """Each indexed file's token count, and the files whose session is in memory."""
    runner = service(server).runner

    def read() -> tuple[dict[str, int], set[str]]:
        entries = runner.session_disk.entries
        return {name: len(e.record) for name, e in entries.items()}, runner.store.resident()

    return on_runner(server, read)


def turn(server: ThreadedServer, messages: list[dict[str, str]]) -> tuple:
    """A chat turn; the reply joins *messages*."""
    done = reply(server, messages)
    messages.append({"role": "assistant", "content": "".join(done[0])})
    return done


@pytest.mark.parametrize("replacement", ["another conversation", "an older copy"])
def test_a_replaced_session_file_is_matched_by_what_it_holds(
    install: Path, codec: TextCodec, tmp_path: Path, replacement: str
) -> None:
    """A's file is replaced while A is only on disk, by B's file or by an older
    copy of A's own: the next turn of A is scored against what the file holds
    now, so the reply is right (it was wrong, or a 500), with a reason."""
    a = [{"role": "user", "content": "Plan a walk along the coast, please."}]
    b = [{"role": "user", "content": "Which tea goes with lemon cake?"}]
    c = [{"role": "user", "content": "Name three rivers in Spain."}]
    older = tmp_path / "older"
    with serving_with_disk(install, codec, tmp_path / "sessions", slots=2) as running:
        turn(running, a)
        (name,) = disk_files(running)[0]
        older.write_bytes((tmp_path / "sessions" / f"{name}{SUFFIX}").read_bytes())
        a.append({"role": "user", "content": "Where do we sleep?"})
        turn(running, a)
        turn(running, b)
        b.append({"role": "user", "content": "And with scones?"})
        turn(running, b)
        turn(running, c)  # A leaves memory: its file is its only copy
        files, resident = disk_files(running)
        (a_file,) = set(files) - resident
        b_file = max(resident, key=files.get)
        source = (
            older if replacement == "an older copy" else tmp_path / "sessions" / f"{b_file}{SUFFIX}"
        )
        shutil.copy(source, tmp_path / "sessions" / f"{a_file}{SUFFIX}")
        a.append({"role": "user", "content": "What should we pack?"})
        ours = reply(running, a)
    if replacement == "an older copy":  # still A's: its tokens are a prefix of the prompt
        assert ours[2]["reuse_reason"] == "restored_from_disk", ours[2]
    with reference(install, codec) as ref:
        assert_same_reply(ours, replayed(ref, a))


# -- the disk bound ---------------------------------------------------------------------


# Each opens differently, so none is a prefix-reuse donor for another.
CONVERSATIONS = [
    "Apples: which kinds keep best in winter?",
    "Bridges: why do some of them sway in wind?",
    "Clouds: how high do the tallest ones rise?",
    "Dunes: how fast do they move each year?",
    "Eels: where do the young ones come from?",
    "Ferns: how do they spread without seeds?",
    "Glaciers: what makes the ice look so blue?",
    "Harbours: why were old ones built so deep?",
]


def bounded_disk(server: ThreadedServer, files: float) -> None:
    """Bound the directory to *files* times the size of the file written so far."""
    runner = service(server).runner

    def bound() -> None:
        disk = runner.session_disk
        (entry,) = disk.entries.values()
        disk.max_bytes = int(files * entry.nbytes)

    on_runner(server, bound)


def test_the_disk_bound_drops_files_of_sessions_in_memory_first(
    install: Path, codec: TextCodec, tmp_path: Path
) -> None:
    """Six conversations through four slots with room for three and a half files:
    the two that left memory keep their files (their only copies) and come back
    from disk; what the bound deleted were files of sessions still in memory."""
    chats = [[{"role": "user", "content": text}] for text in CONVERSATIONS[:6]]
    with serving_with_disk(install, codec, tmp_path, slots=4) as running:
        turn(running, chats[0])
        bounded_disk(running, 3.5)
        for chat in chats[1:]:
            turn(running, chat)
        assert service(running).runner.disk_losses == 0
        for chat in chats[:2]:
            chat.append({"role": "user", "content": "And why?"})
            assert turn(running, chat)[2]["reuse_reason"] == "restored_from_disk"


def test_every_file_the_bound_loses_is_reported(
    install: Path, codec: TextCodec, tmp_path: Path
) -> None:
    """Room for one and a half files and conversations that keep leaving memory:
    each request during which an only copy was deleted says ``evicted``, and the
    count is in /metrics and in the sessions view."""
    chats = [[{"role": "user", "content": text}] for text in CONVERSATIONS]
    with serving_with_disk(install, codec, tmp_path, slots=2) as running:
        runner = service(running).runner
        turn(running, chats[0])
        bounded_disk(running, 1.5)
        for chat in chats[1:]:
            before = on_runner(running, lambda: runner.disk_losses)
            usage = turn(running, chat)[2]
            assert usage["evicted"] == (on_runner(running, lambda: runner.disk_losses) > before)
        losses = runner.disk_losses
        assert losses > 0
        metrics = httpx.get(f"{running.base_url}/metrics").text
        assert f"turbospark_session_disk_evictions_total {losses:.1f}" in metrics
        view = httpx.get(f"{running.base_url}/turbospark/sessions").json()
        assert view["disk"]["evictions"] == losses


# -- a disk that fails, a directory that vanishes ---------------------------------------


def test_a_failing_disk_logs_once_per_session_state(
    install: Path, codec: TextCodec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """Every flush retries the write, but each session state's failure is one
    log line; replies are unaffected."""

    def full(*args: object, **kwargs: object) -> int:
        raise OSError(28, "No space left on device")

    chats = [[{"role": "user", "content": text}] for text in CONVERSATIONS[:3]]
    with serving_with_disk(install, codec, tmp_path, slots=3) as running:
        monkeypatch.setattr("turbospark.sessions.disk_tier.write_session", full)
        with caplog.at_level(logging.WARNING, logger="turbospark.sessions"):
            for chat in chats * 2:  # each flush tries every warm session again
                turn(running, chat)
                chat.append({"role": "user", "content": "More."})
    failures = [r for r in caplog.records if "could not write session" in r.message]
    assert len(failures) == 6, [r.message for r in failures]  # 3 conversations x 2 states


def test_a_vanished_file_and_a_deleted_directory(
    install: Path, codec: TextCodec, tmp_path: Path, caplog
) -> None:
    """A file deleted by hand is one log line (not a failed move and a false
    'moved'); a session directory deleted by hand is recreated at the next write."""
    directory = tmp_path / "sessions"
    a = [{"role": "user", "content": "Plan a walk along the coast, please."}]
    with serving_with_disk(install, codec, directory, slots=2) as running:
        turn(running, a)
        for text in CONVERSATIONS[:2]:  # A leaves memory
            turn(running, [{"role": "user", "content": text}])
        files, resident = disk_files(running)
        (a_file,) = set(files) - resident
        (directory / f"{a_file}{SUFFIX}").unlink()
        a.append({"role": "user", "content": "Where do we sleep?"})
        with caplog.at_level(logging.INFO, logger="turbospark.sessions"):
            ours = reply(running, a)
        lines = [r.message for r in caplog.records if a_file in r.message]
        assert lines == [f"session file {a_file}{SUFFIX} vanished; dropped from the index"]
        shutil.rmtree(directory)
        turn(running, [{"role": "user", "content": CONVERSATIONS[3]}])
        assert list(directory.glob(f"*{SUFFIX}")), "the next write recreated the directory"
    with reference(install, codec) as ref:
        assert_same_reply(ours, replayed(ref, a))
