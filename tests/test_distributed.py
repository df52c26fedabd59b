"""Tensor parallelism on CPU: two processes on MLX's ring backend over loopback.

The multi-process tests start real process groups (``mlx.launch``, or the two
ranks by hand where a test must kill one) and take 10-60 s on two shared cores,
so they are ``slow``; the refusals that need no group are not.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from serving import serving

from turbospark import build_synthetic_install
from turbospark.commands import serve
from turbospark.errors import InvalidInput
from turbospark.text import load_text

HERE = Path(__file__).parent / "distributed"
MLX_LAUNCH = Path(sys.executable).parent / "mlx.launch"
# Sharded matmuls sum in another order: float32 logits of magnitude ~5 differ by
# ~1e-5 at most here (measured 3e-6 to 1e-5); 1e-4 is the bound asserted.
LOGITS_ATOL = 1e-4
STARTUP = 240  # seconds a server group may take to load and warm up on loaded cores


def free_port_range(count: int) -> int:
    """A base port with *count* free ports after it (the ring's one per rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range on loopback")


def launch(*argv: str, n: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """``mlx.launch -n N --backend ring -- python ARGV`` to completion."""
    command = [
        str(MLX_LAUNCH), "-n", str(n), "--backend", "ring",
        "--starting-port", str(free_port_range(n)), "--", sys.executable, *argv,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gemma4_kv_shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 4 with KV-shared layers, one K/V head (repeated across ranks) and k_eq_v."""
    path = tmp_path_factory.mktemp("gemma4_kv_shared")
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=6, num_key_value_heads=1,
        attention_k_eq_v=True, num_global_key_value_heads=1, model_id="gemma4-kv-shared",
    )  # fmt: skip
    return path


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["gemma4_install", "gemma4_kv_shared", "qwen_gdn_install"])
def test_sharded_logits_equal_unsharded(fixture, request, tmp_path):
    install = request.getfixturevalue(fixture)
    done = launch(str(HERE / "logits.py"), str(install), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.{rank}").read_text())
        sharded, whole = result["params"]
        assert sharded < 0.75 * whole, "the model was not sharded"
        state, whole_state = result["state_bytes"]
        # Sharded by head: half; a lone K/V head is repeated, so each rank keeps all of it.
        assert state == (whole_state if fixture == "gemma4_kv_shared" else whole_state // 2)
        assert result["diff"] <= LOGITS_ATOL, result


@pytest.mark.slow
def test_every_rank_refuses_bad_groups_with_one_line(gemma4_install, qwen4_exp_install, tmp_path):
    other = tmp_path / "other"  # the same arch, other weights: another manifest
    build_synthetic_install("gemma4", other, vocab_size=128, num_layers=2, seed=7)
    three_heads = tmp_path / "three_heads"
    build_synthetic_install(
        "gemma4", three_heads, vocab_size=128, num_layers=2, num_attention_heads=3,
        num_key_value_heads=1,
    )  # fmt: skip
    cases = {
        "mismatch": (gemma4_install, other),
        "heads": (three_heads, three_heads),
        "family": (qwen4_exp_install, qwen4_exp_install),
        "streamed": (gemma4_install, f"{gemma4_install}@4"),  # fixed(4) experts on both
        "fine": (gemma4_install, gemma4_install),  # after three refusals, still in step
    }
    argv = [f"{name}={a},{b}" for name, (a, b) in cases.items()]
    done = launch(str(HERE / "refusals.py"), str(tmp_path / "out"), *argv)
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        assert got["fine"] is None
        assert got["mismatch"].startswith("mismatched models (verified manifests) across ranks")
        assert "open the same checkpoint on every rank" in got["mismatch"]
        assert got["heads"].startswith("world size 2 does not divide num_attention_heads=3")
        assert "mlx.launch -n 3" in got["heads"]
        assert got["family"].startswith("family 'qwen4_exp' cannot be sharded across 2")
        assert got["streamed"].startswith("--expert-cache-slots 4 streams experts")
        assert all("\n" not in message for message in got.values() if message)


def test_distributed_serve_refuses_a_session_dir_and_a_bad_timeout(tmp_path):
    parser = serve_parser()
    args = parser.parse_args(
        ["serve", str(tmp_path), "--distributed", "--session-slots", "2", "--session-dir", "d"]
    )
    with pytest.raises(InvalidInput, match="--session-dir with --distributed"):
        serve.check_args(args)
    args = parser.parse_args(["serve", str(tmp_path), "--distributed", "--draft", "ngram"])
    with pytest.raises(InvalidInput, match="--draft ngram with --distributed"):
        serve.check_args(args)
    args = parser.parse_args(["serve", str(tmp_path), "--distributed-timeout", "0"])
    with pytest.raises(InvalidInput, match="--distributed-timeout must be positive"):
        serve.check_args(args)


def test_distributed_serve_alone_is_refused(gemma4_install):
    done = subprocess.run(
        [sys.executable, "-m", "turbospark", "serve", str(gemma4_install), "--distributed"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLX_")},
    )
    assert done.returncode == 2
    assert "this process is alone" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def serve_parser():
    import argparse

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser


# -- serving with TP=2 --------------------------------------------------------------


class Group:
    """``turbospark serve --distributed`` as two ranks started by hand (the
    hostfile mlx.launch would write), so a test can stop or kill one."""

    def __init__(self, install: Path, tmp: Path, *flags: str, rank1: tuple[str, ...] = ()) -> None:
        ring = free_port_range(2)
        hostfile = tmp / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
        self.port = free_port_range(1)
        command = [
            sys.executable, "-m", "turbospark", "serve", str(install), "--distributed",
            "--port", str(self.port), "--chunk-size", "16", "--context-length", "512", *flags,
        ]  # fmt: skip
        self.ranks = [
            subprocess.Popen(
                command + (list(rank1) if rank == 1 else []),
                env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)},
                stdout=subprocess.DEVNULL,
                stderr=open(tmp / f"rank{rank}.err", "w"),  # noqa: SIM115
            )
            for rank in (0, 1)
        ]
        self.tmp = tmp
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + STARTUP
        while time.monotonic() < deadline:
            for rank, process in enumerate(self.ranks):
                assert process.poll() is None, self.stderr(rank)
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).json()["status"] == "ok":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("the group did not come up:\n" + self.stderr(0))

    def stderr(self, rank: int) -> str:
        return (self.tmp / f"rank{rank}.err").read_text()

    def close(self) -> None:
        for process in self.ranks:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait(timeout=30)


def conversation_script(client: openai.OpenAI, model: str) -> list[tuple]:
    """The seed scenarios' shapes through the server, 2 session slots: a long
    conversation, a shallow match that must not destroy it, the conversation
    coming back (whole reuse), a third one that evicts the least recent, and a
    batch of two. Returns each reply's text and reuse facts."""
    long_a = "tell me a long story about the sea " * 6
    turns = [
        ("a", [{"role": "user", "content": long_a}]),
        ("b", [{"role": "user", "content": "hi"}]),  # shares only the template's opening
        ("a", None),  # a's second turn: the whole first exchange is reused
        ("c", [{"role": "user", "content": "something else entirely, at length " * 4}]),
        ("b", None),
    ]
    history: dict[str, list[dict]] = {}
    out = []
    for name, opening in turns:
        messages = history.setdefault(name, opening or [])
        if opening is None:
            messages.append({"role": "user", "content": f"and then? ({len(messages)})"})
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0.0
        )
        text = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        extra = reply.usage.model_extra["turbospark"]
        out.append((
            name, text, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens,
            extra["reuse_reason"], extra["swapped"], extra["evicted"],
        ))  # fmt: skip
    batch = client.chat.completions.create(
        model=model, messages=history["c"], max_tokens=5, temperature=0.0, n=2
    )
    out.append(tuple(choice.message.content for choice in batch.choices))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["gemma4_install", "qwen_gdn_install"])
def test_tp2_serves_the_seed_scenarios_exactly_as_one_process(fixture, request, tmp_path):
    install = request.getfixturevalue(fixture)
    model = json.loads((install / "manifest.json").read_text())["model_id"]
    group = Group(install, tmp_path, "--session-slots", "2")
    try:
        with serving(install, load_text(install), 2, context=512, chunk_size=16) as alone:
            expected = conversation_script(openai.OpenAI(base_url=f"{alone.base_url}/v1",
                                                         api_key="-", max_retries=0), model)  # fmt: skip
        group.wait_ready()
        client = openai.OpenAI(base_url=f"{group.base_url}/v1", api_key="-", max_retries=0)
        got = conversation_script(client, model)
    finally:
        group.close()
    assert got == expected
    a_first, a_again = got[0], got[2]
    assert a_again[3] >= a_first[2] - 1, "the shallow match destroyed conversation a"
    # Two slots: c parks a and drops b; b, back, parks c and drops a.
    assert [turn[6] for turn in got[:5]] == [False, False, False, True, True]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_rank_that_dies_or_hangs_ends_the_group(how, gemma4_install, tmp_path):
    group = Group(gemma4_install, tmp_path, "--distributed-timeout", "5")
    try:
        group.wait_ready()
        rank0, rank1 = group.ranks
        rank1.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        rank0.wait(timeout=60)  # bounded: never a hang
        took = time.monotonic() - started
    finally:
        group.close()
    assert rank0.returncode == 1
    # MLX's ring threads print to the same stderr as the rank dies: their text may
    # stand before our line on its row, never inside it (it is one write).
    if how == "killed":
        what, bound = r"lost a peer \(.*\)", 30
    else:
        what, bound = r"no step from the group for \d+ s \(.*\)", 5 + 30
    line = rf"turbospark: rank 0 of 2: {what}; every rank stops\n"
    assert re.search(line, group.stderr(0)), group.stderr(0)
    assert took < bound


@pytest.mark.slow
def test_ranks_started_with_different_engine_flags_are_refused(gemma4_install, tmp_path):
    group = Group(gemma4_install, tmp_path, "--session-slots", "2", rank1=("--max-batch", "4"))
    try:
        codes = [process.wait(timeout=STARTUP) for process in group.ranks]
    finally:
        group.close()
    assert codes == [2, 2]
    for rank in (0, 1):
        line = group.stderr(rank).strip().splitlines()[-1]
        assert "mismatched serve flags across ranks: rank(s) [1] differ from rank 0" in line
        assert "start every rank with the same --session-slots" in line


@pytest.mark.slow
def test_a_client_that_hangs_up_leaves_the_ranks_in_step(gemma4_install, tmp_path):
    """The cancel reaches every rank at the same step (rank 0 broadcasts it), so the
    group goes on serving: a diverged pair would hang or fail the next request."""
    model = json.loads((gemma4_install / "manifest.json").read_text())["model_id"]
    group = Group(gemma4_install, tmp_path, "--session-slots", "2")
    try:
        group.wait_ready()
        client = openai.OpenAI(base_url=f"{group.base_url}/v1", api_key="-", max_retries=0)
        messages = [{"role": "user", "content": "a long answer please"}]
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=400, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))
        stream.close()  # hang up mid-generation
        for _ in range(2):
            reply = client.chat.completions.create(
                model=model, messages=messages, max_tokens=4, n=2
            )
            assert len(reply.choices) == 2
        # What does not run in lockstep is refused by name, and the group goes on.
        with pytest.raises(openai.BadRequestError, match="not served under --distributed"):
            client.embeddings.create(model=model, input="hello")
        with pytest.raises(openai.BadRequestError, match="per-request steering is not carried"):
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=2,
                extra_body={"turbospark": {"steering": {"mode": "off"}}},
            )  # fmt: skip
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=4, extra_body={"ignore_eos": True}
        )  # sampled at the default temperature: an early end-of-turn must not end it
        assert reply.choices[0].finish_reason == "length"
        assert all(process.poll() is None for process in group.ranks)
    finally:
        group.close()
