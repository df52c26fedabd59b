"""``turbospark serve --session-dir``: a real server process, killed (SIGKILL) or
stopped (SIGTERM) between turns and started again on the same directory,
answers the next turn from the session it wrote (write-through after each
request; everything warm again at shutdown)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from serving import serve_process

from turbospark import build_synthetic_install
from turbospark.text import TextCodec, load_text

MODEL = "tiny-restart"


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("restart-gemma4")
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, sliding_window=8, model_id=MODEL
    )
    return path


@contextmanager
def serve(install: Path, session_dir: Path) -> Iterator[tuple[subprocess.Popen, openai.OpenAI]]:
    """``turbospark serve`` as its own process; yields it once /health answers."""
    flags = ["--session-slots", "2", "--session-dir", str(session_dir)]
    with serve_process(install, *flags) as (process, base):
        yield process, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def turn(api: openai.OpenAI, codec: TextCodec, messages: list[dict[str, str]]) -> tuple[int, dict]:
    """One chat turn; the reply joins *messages*. Returns the prompt's length and
    the usage (cached tokens plus turbospark's reuse extension)."""
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    usage = reply.usage
    details = {
        "cached": usage.prompt_tokens_details.cached_tokens,
        **usage.model_extra["turbospark"],
    }
    return usage.prompt_tokens, details


@pytest.mark.slow  # serve processes killed and restarted: a process group, ~4 s
def test_a_conversation_survives_sigkill_and_sigterm(install: Path, tmp_path: Path) -> None:
    codec = load_text(install)
    chat = [{"role": "user", "content": "Plan a three day walk along the coast, please."}]
    other = [{"role": "user", "content": "Which tea goes with lemon cake?"}]
    with serve(install, tmp_path) as (process, api):
        first, _ = turn(api, codec, chat)
        turn(api, codec, other)  # a second warm conversation, live when the process dies
        process.send_signal(signal.SIGKILL)
        process.wait()

    chat.append({"role": "user", "content": "And where do we sleep on the second night?"})
    with serve(install, tmp_path) as (process, api):
        second, usage = turn(api, codec, chat)
        assert usage["reuse_reason"] == "restored_from_disk", usage
        assert usage["cached"] >= first
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
        # uvicorn re-raises the signal once its graceful shutdown (our flush) is done.
        assert "Application shutdown complete" in output, output

    assert not list(tmp_path.glob(".tmp-*")) and not list((tmp_path / "rejected").iterdir())
    chat.append({"role": "user", "content": "Thanks. What should we pack?"})
    other.append({"role": "user", "content": "And with a plain scone?"})
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10" * 64)  # refused, and served on
    with serve(install, tmp_path) as (process, api):
        _, usage = turn(api, codec, chat)
        assert usage["reuse_reason"] == "restored_from_disk" and usage["cached"] >= second
        _, usage = turn(api, codec, other)
        assert usage["reuse_reason"] == "restored_from_disk", usage
    assert (tmp_path / "rejected" / "garbage.safetensors").is_file()
    assert "refused session file garbage.safetensors (unreadable)" in process.stdout.read()


@pytest.mark.parametrize(
    "flags, named",
    [(["--max-session-disk", "1GiB"], "--session-dir DIR"),
     (["--session-dir", "DIR"], "--session-slots 2 or more")],
)  # fmt: skip
def test_serve_refuses_bad_disk_flags_in_one_line(install, tmp_path, capsys, flags, named):
    from turbospark.cli import main

    args = [str(tmp_path) if f == "DIR" else f for f in flags]
    assert main(["serve", str(install), *args]) == 2
    assert named in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "refused before the directory was touched"
