"""The disk tier: sessions evicted from memory, flushed and restarted
are found again and resume exactly; untrustworthy files are refused, moved
aside and never served; the directory stays within its bound."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from helpers import serve_turn, text_positions
from turbospark import InvalidInput, ReuseReason, Runner, build_synthetic_install
from turbospark.sessions.disk_tier import REJECTED
from turbospark.sessions.session_file import read_meta

CONVERSATIONS = [[1, 3, 10 + i, *range(40 + i, 60 + i)] for i in range(3)]  # 23 tokens each


def fresh_logits(path: Path, prompt: list[int], kept: int) -> mx.array:
    """What an uninterrupted runner computes when *kept* tokens were in state and
    the rest was fed in one chunk (the split matters for GDN's chunkwise math)."""
    runner = Runner.open(path)
    if kept:
        runner.prefill_chunk(prompt[:kept], 0)
    return runner.prefill_chunk(prompt[kept:], kept)


def disk_runner(path: Path, directory: Path, slots: int = 2, **options: object) -> Runner:
    runner = Runner.open(path, session_slots=slots, session_dir=directory, **options)
    runner.set_prefix_reuse(True)
    return runner


def session_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_evicted_and_restarted_sessions_resume_exactly(family, request, tmp_path):
    install = request.getfixturevalue(f"{family}_install")
    runner = disk_runner(install, tmp_path)
    for conversation in CONVERSATIONS:  # two slots: the third parks the second, a spills
        serve_turn(runner, conversation)
        assert not runner.session_slot_evicted(), "a session written to disk is not lost"
    assert len(session_files(tmp_path)) == 1
    follow = [*CONVERSATIONS[0], 5, 6]
    kept, logits = serve_turn(runner, follow)
    assert runner.last_reuse.reason == ReuseReason.RESTORED_FROM_DISK, runner.last_reuse
    assert kept == len(CONVERSATIONS[0]) and "ms" in runner.last_reuse.detail
    assert mx.allclose(logits, fresh_logits(install, follow, kept), atol=1e-5)

    runner.close()  # shutdown: every warm session goes to disk
    assert len(session_files(tmp_path)) == 3
    restarted = disk_runner(install, tmp_path)
    for conversation in (CONVERSATIONS[1], CONVERSATIONS[2], follow):
        prompt = [*conversation, 9]
        kept, logits = serve_turn(restarted, prompt)
        assert restarted.last_reuse.reason == ReuseReason.RESTORED_FROM_DISK, restarted.last_reuse
        assert kept == len(conversation)
        assert mx.allclose(logits, fresh_logits(install, prompt, kept), atol=1e-5)
    assert not restarted.session_disk.rejected


def test_a_gdn_session_resumes_from_its_checkpoint_after_a_restart(qwen_gdn_install, tmp_path):
    """The prompt-boundary checkpoints are in the file: a next prompt that
    re-tokenises the reply still resumes at the prompt's end, not from zero."""
    runner = disk_runner(qwen_gdn_install, tmp_path)
    prompt = CONVERSATIONS[0]
    serve_turn(runner, prompt)
    runner.prefill_chunk([70, 71, 72], len(prompt))  # the reply as generated
    runner.close()
    restarted = disk_runner(qwen_gdn_install, tmp_path)
    follow = [*prompt, 70, 99, 98]  # the reply as re-tokenised
    kept, logits = serve_turn(restarted, follow)
    report = restarted.last_reuse
    assert (kept, report.reason) == (len(prompt), ReuseReason.RESTORED_FROM_DISK), report
    assert "checkpoint" in report.detail
    assert mx.allclose(logits, fresh_logits(qwen_gdn_install, follow, kept), atol=1e-5)


def test_a_shallow_disk_match_is_not_loaded_and_the_file_stays_intact(gemma4_install, tmp_path):
    """Disk sessions obey the pool's rule: a template-deep match never takes
    (or cuts) a disk session; the new conversation shares a parked opening."""
    runner = disk_runner(gemma4_install, tmp_path)
    serve_turn(runner, CONVERSATIONS[0])
    runner.close()
    restarted = disk_runner(gemma4_install, tmp_path)
    newcomer = [1, 3, 10, 100, 101]  # 3 tokens shared with a 23-token disk session
    kept, _ = serve_turn(restarted, newcomer)
    assert (kept, restarted.last_reuse.reason) == (0, ReuseReason.NO_HISTORY)
    restarted.close()
    names = [p.stem for p in session_files(tmp_path)]
    assert len(names) == 2
    again = disk_runner(gemma4_install, tmp_path)
    kept, _ = serve_turn(again, [*CONVERSATIONS[0], 5])
    assert kept == len(CONVERSATIONS[0]), again.last_reuse


def test_vision_sessions_never_reach_the_disk(gemma4_install, tmp_path):
    runner = disk_runner(gemma4_install, tmp_path)
    image_prompt = [1, 3, 30, 31, 32, 33]
    runner.set_prompt_vision([], text_positions(len(image_prompt)), len(image_prompt))
    serve_turn(runner, image_prompt)
    runner.clear_prompt_vision()
    assert runner.flush() == 0 and not session_files(tmp_path)
    serve_turn(runner, CONVERSATIONS[0])  # parks the tainted session
    serve_turn(runner, CONVERSATIONS[1])  # evicts it: lost, and reported so
    assert runner.session_slot_evicted()
    assert runner.flush() == 2 and len(session_files(tmp_path)) == 2


@pytest.fixture
def saved(gemma4_install: Path, tmp_path: Path) -> Path:
    """A directory holding the three conversations, written at shutdown."""
    runner = disk_runner(gemma4_install, tmp_path)
    for conversation in CONVERSATIONS:
        serve_turn(runner, conversation)
    runner.close()
    return tmp_path


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _clip_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:50])


@pytest.mark.parametrize(
    "damage, reason, at_open",
    [(_flip_last_byte, "checksum", False), (_truncate, "unreadable", False),
     (_clip_header, "unreadable", True)],
)  # fmt: skip
def test_a_damaged_file_is_refused_moved_aside_and_the_runner_keeps_serving(
    gemma4_install, saved, caplog, damage, reason, at_open
):
    victim = next(p for p in session_files(saved) if read_meta(p).tokens == CONVERSATIONS[1])
    damage(victim)
    with caplog.at_level(logging.WARNING, logger="turbospark.sessions"):
        runner = disk_runner(gemma4_install, saved)
        assert (len(runner.session_disk.entries) == 2) == at_open
        prompt = [*CONVERSATIONS[1], 5]
        kept, logits = serve_turn(runner, prompt)
    assert runner.session_disk.rejected == [(victim.name, reason)]
    assert f"refused session file {victim.name} ({reason})" in caplog.text
    moved = saved / REJECTED / victim.name
    assert moved.is_file() and not victim.exists()
    assert moved.with_suffix(".reason").read_text().startswith(reason)
    # Not served: the prompt was prefilled (sharing only the opening), and exactly.
    assert kept < len(CONVERSATIONS[1]) and runner.last_reuse.reason != "restored_from_disk"
    assert mx.allclose(logits, fresh_logits(gemma4_install, prompt, kept), atol=1e-5)
    kept, _ = serve_turn(runner, [*CONVERSATIONS[2], 5])  # the others still serve
    assert runner.last_reuse.reason == ReuseReason.RESTORED_FROM_DISK, runner.last_reuse


def test_a_file_from_another_model_is_refused(gemma4_install, saved, tmp_path_factory, caplog):
    other = tmp_path_factory.mktemp("other-gemma4")
    build_synthetic_install(
        "gemma4", other, vocab_size=128, num_layers=2, num_experts=16, top_k_experts=4,
        sliding_window=8, model_id="tiny-gemma4-session-pool", seed=1,
    )  # fmt: skip
    foreign_dir = tmp_path_factory.mktemp("foreign-sessions")
    runner = disk_runner(other, foreign_dir)
    serve_turn(runner, [*CONVERSATIONS[0], 7])  # longer than ours: it would score best
    runner.close()
    (foreign,) = session_files(foreign_dir)
    shutil.copy(foreign, saved / foreign.name)
    with caplog.at_level(logging.WARNING, logger="turbospark.sessions"):
        ours = disk_runner(gemma4_install, saved)
    assert ours.session_disk.rejected == [(foreign.name, "foreign")]
    assert "never loaded into a different model" in caplog.text
    prompt = [*CONVERSATIONS[0], 7, 8]
    kept, logits = serve_turn(ours, prompt)
    assert kept == len(CONVERSATIONS[0]), ours.last_reuse  # our own copy, not theirs
    assert mx.allclose(logits, fresh_logits(gemma4_install, prompt, kept), atol=1e-5)


def test_the_directory_stays_within_its_bound(gemma4_install, saved, caplog):
    sizes = [p.stat().st_size for p in session_files(saved)]
    with caplog.at_level(logging.WARNING, logger="turbospark.sessions"):
        runner = disk_runner(gemma4_install, saved, max_session_disk_bytes=2 * max(sizes))
    assert len(session_files(saved)) == 2 and runner.session_disk.evictions == 1
    assert "evicted session file" in caplog.text
    # The oldest (the first conversation) went; the newest two are still found.
    kept, _ = serve_turn(runner, [*CONVERSATIONS[2], 5])
    assert kept == len(CONVERSATIONS[2]), runner.last_reuse
    serve_turn(runner, [*CONVERSATIONS[0], 5])
    assert runner.last_reuse.reason != ReuseReason.RESTORED_FROM_DISK
    runner.close()
    assert sum(p.stat().st_size for p in session_files(saved)) <= 2 * max(sizes)


def test_disk_options_are_checked_before_loading(gemma4_install, tmp_path):
    with pytest.raises(InvalidInput, match="session_slots 2 or more"):
        Runner.open(gemma4_install, session_dir=tmp_path)
    with pytest.raises(InvalidInput, match="pass session_dir too"):
        Runner.open(gemma4_install, session_slots=2, max_session_disk_bytes=10)
    with pytest.raises(InvalidInput, match="0 or more"):
        Runner.open(
            gemma4_install, session_slots=2, session_dir=tmp_path, max_session_disk_bytes=-1
        )


_WRITER = """
import os, sys
os.environ["TURBOSPARK_PLUGINS"] = "gemma4"
import mlx.core as mx
mx.set_default_device(mx.cpu)
from turbospark import Runner
runner = Runner.open(sys.argv[1], session_slots=2, session_dir=sys.argv[2])
tokens = [1, 3, *range(40, 100)]
runner.prefill_chunk(tokens[:2], 0)
for n in range(2, len(tokens)):
    runner.prefill_chunk([tokens[n]], n)
    runner.flush()  # rewrites the same file, one token longer each time
    if n == 4:
        print("writing", flush=True)
"""


def test_a_kill_during_writes_leaves_a_whole_file(gemma4_install, tmp_path):
    """SIGKILL a process rewriting its session file as fast as it can: what is
    left is the old file or the new one, and it verifies and resumes."""
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(gemma4_install), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline() == "writing\n"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    runner = disk_runner(gemma4_install, tmp_path)
    assert not runner.session_disk.rejected and not list(tmp_path.glob(".tmp-*"))
    (entry,) = runner.session_disk.entries.values()
    tokens = list(entry.record.tokens)
    assert tokens == [1, 3, *range(40, 40 + len(tokens) - 2)]
    prompt = [*tokens, 7]
    kept, logits = serve_turn(runner, prompt)
    assert kept == len(tokens) and runner.last_reuse.reason == ReuseReason.RESTORED_FROM_DISK
    assert mx.allclose(logits, fresh_logits(gemma4_install, prompt, kept), atol=1e-5)


def _as_version_1(path: Path) -> None:
    """Rewrite a session file the way format version 1 hashed it: one sha256 stream
    over the metadata and every tensor's name, dtype, shape and bytes (written here
    independently of turbospark.sessions.session_file)."""
    import hashlib
    import json

    arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    meta = json.loads(metadata["turbospark"])
    meta.update(version=1, content_sha256="")
    digest = hashlib.sha256(json.dumps(meta, separators=(",", ":")).encode())
    for name in sorted(arrays):
        value = arrays[name]
        digest.update(f"\0{name}\0{value.dtype}\0{tuple(value.shape)}\0".encode())
        digest.update(memoryview(value))
    meta["content_sha256"] = digest.hexdigest()
    mx.save_safetensors(str(path), arrays, metadata={"turbospark": json.dumps(meta, separators=(",", ":"))})  # fmt: skip


def test_a_version_1_file_still_loads_and_is_still_verified(gemma4_install, saved):
    victim = next(p for p in session_files(saved) if read_meta(p).tokens == CONVERSATIONS[1])
    _as_version_1(victim)
    assert read_meta(victim).version == 1
    damaged = victim.read_bytes()
    runner = disk_runner(gemma4_install, saved)
    prompt = [*CONVERSATIONS[1], 5]
    kept, logits = serve_turn(runner, prompt)
    assert runner.last_reuse.reason == ReuseReason.RESTORED_FROM_DISK, runner.last_reuse
    assert mx.allclose(logits, fresh_logits(gemma4_install, prompt, kept), atol=1e-5)
    runner.close()  # the session grew: it is written again, as version 2
    victim.write_bytes(damaged)
    _flip_last_byte(victim)
    runner = disk_runner(gemma4_install, saved)
    serve_turn(runner, prompt)
    assert [reason for _, reason in runner.session_disk.rejected] == ["checksum"]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32, mx.int32, mx.bool_])
def test_every_state_dtype_round_trips_bit_for_bit(tmp_path, dtype):
    from turbospark.sessions.session import Checkpoint, SessionSnapshot
    from turbospark.sessions.session_file import ModelIdentity, read_session, write_session

    values = mx.random.normal((3, 5, 7)) * 100
    state = {"kv": {"keys": values.astype(dtype), "offset": mx.array([4], dtype=mx.int32)}}
    snapshot = SessionSnapshot(
        tokens=[1, 2, 3, 4], tainted=False, arrays=state,
        checkpoints=(Checkpoint(2, {"kv": {"keys": values[:, :2].astype(dtype)}}),),
    )  # fmt: skip
    model = ModelIdentity(family="f", manifest_sha256="0" * 64, dtype=str(dtype))
    write_session(tmp_path / "s.safetensors", snapshot, model, ["kv"])
    meta, loaded = read_session(tmp_path / "s.safetensors", model)
    assert meta.tokens == [1, 2, 3, 4] and meta.checkpoints == [2]
    for got, want in [(loaded.arrays["kv"]["keys"], state["kv"]["keys"]),
                      (loaded.checkpoints[0].snapshots["kv"]["keys"], values[:, :2].astype(dtype))]:  # fmt: skip
        assert got.dtype == want.dtype and got.shape == want.shape
        assert bytes(memoryview(got)) == bytes(memoryview(mx.contiguous(want)))


def test_a_tensor_of_a_dtype_no_session_holds_is_refused(tmp_path):
    """float64 (which MLX would quietly read back as float32) is refused as
    unreadable, naming the dtype, instead of coming back as another array."""
    from turbospark.sessions.session import SessionSnapshot
    from turbospark.sessions.session_file import (
        ModelIdentity,
        RejectReason,
        SessionFileError,
        read_session,
        write_session,
    )

    state = {"kv": {"keys": mx.arange(6, dtype=mx.int64).reshape(2, 3)}}
    snapshot = SessionSnapshot(tokens=[1, 2], tainted=False, arrays=state, checkpoints=())
    model = ModelIdentity(family="f", manifest_sha256="0" * 64, dtype="mlx.core.float32")
    path = tmp_path / "s.safetensors"
    write_session(path, snapshot, model, ["kv"])
    raw = path.read_bytes()
    assert raw.count(b'"I64"') == 1
    path.write_bytes(raw.replace(b'"I64"', b'"F64"'))  # same size, a dtype we do not read
    with pytest.raises(SessionFileError) as refused:
        read_session(path, model)
    assert refused.value.reason == RejectReason.UNREADABLE
    assert "unsupported dtype" in str(refused.value) and "F64" in str(refused.value)
