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
import mmap
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
from turbospark.generation.runner import Runner
from turbospark.sessions import session_file as disk
from turbospark.sessions.reuse import ReuseReason

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


def _breakdown(directory: Path, path: Path) -> dict[str, float]:
    """Where a reload's time goes, each part timed alone on the file just written
    (ms): the sha256 of every tensor from a memory map (threads), ``mx.load`` and
    evaluating its arrays, and the whole ``read_session`` (both, overlapped)."""
    (file,) = directory.glob(f"*{disk.SUFFIX}")
    meta = disk.read_meta(file)
    runner = Runner.open(path, session_slots=2, session_dir=directory)
    model = runner.session_disk.model
    runner.session_disk.close()
    parts = {}
    start = time.perf_counter()
    with file.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        _, views = disk._tensor_views(file, view)
        hashes = disk._hash_tensors(meta, views)
        [f.result() for f in hashes.values() if hasattr(f, "result")]
        del views, view
    parts["hash_ms"] = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    arrays = mx.load(str(file), format="safetensors")
    mx.eval(list(arrays.values()))
    parts["mx_load_ms"] = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    mx.eval([a * 1 for a in arrays.values()])
    mx.synchronize()
    parts["first_device_use_ms"] = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    _, snapshot = disk.read_session(file, model)
    mx.eval(snapshot.arrays)
    parts["read_session_ms"] = (time.perf_counter() - start) * 1e3
    return parts


def bench_session_disk(
    path: Path, lengths: list[int], reps: int, breakdown: bool = False
) -> dict[str, Any]:
    rows = []
    for length in lengths:
        context = length + 8
        tokens = random_tokens(length, Runner.open(path).vocab_size, seed=length)
        prefills, writes, reloads, sizes, parts = [], [], [], [], []
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
                if breakdown:
                    parts.append(_breakdown(directory, path))
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
            **({f"{k}_median": statistics.median(p[k] for p in parts) for k in parts[0]}
               if parts else {}),
        })  # fmt: skip
    return {"reps": reps, "chunk": CHUNK, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", action="append", choices=list(FAMILIES))
    parser.add_argument("--size", default=None, help="bench/common.py SIZES key (default small)")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--gpu", action="store_true", help="large shapes in bfloat16 (the GPU plan)"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="also time hashing, mx.load and first use alone"
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
            result = bench_session_disk(path, lengths, args.reps, args.breakdown)
            lines.append({"family": family, "size": size, "dtype": dtype, "piece": "session_disk",
                          "seconds": time.perf_counter() - started, "result": result})  # fmt: skip
        print(json.dumps(lines[-1]), flush=True)
        if sink is not None:
            sink.write(json.dumps(lines[-1]) + "\n")
            sink.flush()


if __name__ == "__main__":
    main()
