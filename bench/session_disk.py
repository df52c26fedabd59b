"""Reloading a session from disk against prefilling it again, and what it costs on disk.

For each history length ``L``: a runner with a session directory prefills
``L`` tokens (timed: that is what a lost session costs, "re-prefill"), then
writes it (``flush``, timed, with the file's size: bytes per token). A second
runner opened on the same directory (a restart: the index is read from the
headers) serves ``L`` tokens plus one: the session file wins the prompt and is
loaded, verified (sha256) and installed (timed around ``try_reuse_prefix``,
which must answer ``restored_from_disk`` keeping ``L``). The file was just
written, so it is read from the page cache: this is a restart on a warm
machine, not a cold disk.

    python bench/session_disk.py [--family F] [--size small] [--lengths 1024,4096,16384]
    python bench/session_disk.py --gpu --out DIR     # large shapes, bf16, JSON lines to DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install, machine, random_tokens
from turbospark.reuse import ReuseReason
from turbospark.runner import Runner

CHUNK = 512


def _prefill(runner: Runner, tokens: list[int]) -> float:
    start = time.perf_counter()
    for begin in range(0, len(tokens), CHUNK):
        runner.prefill_chunk(tokens[begin : begin + CHUNK], begin, logits=False)
    mx.synchronize()
    return time.perf_counter() - start


def _reload(path: Path, directory: Path, tokens: list[int], context: int) -> float:
    """A restarted runner finds the session on disk; seconds to load and install it."""
    runner = Runner.open(path, context_length=context, session_slots=2, session_dir=directory)
    runner.set_prefix_reuse(True)
    start = time.perf_counter()
    kept = runner.try_reuse_prefix([*tokens, 7])
    mx.eval([a for c in runner.session_states()[0].values() for a in c.arrays()])
    mx.synchronize()
    seconds = time.perf_counter() - start
    if kept != len(tokens) or runner.last_reuse.reason != ReuseReason.RESTORED_FROM_DISK:
        raise RuntimeError(f"expected a disk restore keeping {len(tokens)}: {runner.last_reuse}")
    runner.session_disk.close()
    return seconds


def bench_session_disk(path: Path, lengths: list[int], reps: int) -> dict[str, Any]:
    rows = []
    for length in lengths:
        context = length + 8
        tokens = random_tokens(length, Runner.open(path).vocab_size, seed=length)
        prefills, writes, reloads, sizes = [], [], [], []
        for _ in range(reps):
            directory = Path(tempfile.mkdtemp(prefix="session-disk-"))
            try:
                runner = Runner.open(
                    path, context_length=context, session_slots=2, session_dir=directory
                )
                prefills.append(_prefill(runner, tokens))
                start = time.perf_counter()
                runner.flush()
                writes.append(time.perf_counter() - start)
                sizes.append(runner.session_disk.nbytes)
                runner.session_disk.close()
                del runner
                reloads.append(_reload(path, directory, tokens, context))
            finally:
                shutil.rmtree(directory)
        prefill, reload = statistics.median(prefills), statistics.median(reloads)
        rows.append({
            "history_tokens": length,
            "reprefill_ms": prefill * 1e3,
            "reload_ms": reload * 1e3,
            "reload_speedup": prefill / reload,
            "write_ms": statistics.median(writes) * 1e3,
            "file_bytes": sizes[0],
            "bytes_per_token": sizes[0] / length,
        })  # fmt: skip
    return {"reps": reps, "chunk": CHUNK, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", action="append", choices=list(FAMILIES))
    parser.add_argument("--size", default=None, help="bench/common.py SIZES key (default small)")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--gpu", action="store_true", help="large shapes in bfloat16 (bench/gpu.py)"
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument(
        "--out", type=Path, default=None, help="append JSON lines to disk.jsonl in this folder"
    )
    args = parser.parse_args()
    if not args.gpu:
        mx.set_default_device(mx.cpu)
    dtype = "bfloat16" if args.gpu else default_dtype()
    size = args.size or ("large" if args.gpu else "small")
    lengths = [int(n) for n in args.lengths.split(",")]
    sink = None
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        sink = (args.out / "disk.jsonl").open("a")
    lines = [{"piece": "machine", "result": machine()}]
    for family in [None, *(args.family or FAMILIES)]:
        if family is not None:
            started = time.perf_counter()
            path = install(family, size, dtype, args.cache_dir)
            result = bench_session_disk(path, lengths, args.reps)
            lines.append({"family": family, "size": size, "dtype": dtype, "piece": "session_disk",
                          "seconds": time.perf_counter() - started, "result": result})  # fmt: skip
        print(json.dumps(lines[-1]), flush=True)
        if sink is not None:
            sink.write(json.dumps(lines[-1]) + "\n")
            sink.flush()


if __name__ == "__main__":
    main()
