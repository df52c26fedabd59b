"""A GPU run in pieces that each print (and save) their result as soon as they end.

A device lease is short and a killed process prints nothing, so unlike
``run.py`` this driver writes one JSON line per finished piece::

    python bench/gpu.py OUT_DIR [--family F ...] [--only forward|swap|interleaved|serving|concurrency|tp]

``--only tp`` needs two GPUs (``nvidia-h200-x2``): TP=2 against TP=1 on the
~8B shape through NCCL (``bench/tp.py``), whatever ``--size`` says.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import install, machine
from bench.concurrency import bench_concurrency
from bench.forward import bench_forward
from bench.interleaved import bench_interleaved
from bench.run import GPU
from bench.serving import bench_servers
from bench.swap import bench_swap
from bench.tp import bench_tp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", action="append", choices=["gemma4", "qwen_gdn"])
    parser.add_argument(
        "--only",
        action="append",
        choices=["forward", "swap", "interleaved", "serving", "concurrency", "tp"],
    )
    parser.add_argument("--size", default="large")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/bench-cache"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sink = (args.out / "gpu.jsonl").open("a")

    def emit(family: str, piece: str, result: object, started: float) -> None:
        line = {
            "family": family,
            "piece": piece,
            "seconds": time.perf_counter() - started,
            "result": result,
        }
        print(json.dumps(line), flush=True)
        sink.write(json.dumps(line) + "\n")
        sink.flush()

    emit("-", "machine", machine(), time.perf_counter())
    for family in args.family or ["gemma4", "qwen_gdn"]:
        for piece in args.only or ["forward", "swap", "interleaved"]:
            started = time.perf_counter()
            if piece == "forward":
                path = install(family, args.size, "bfloat16", args.cache_dir)
                result = bench_forward(path, prompt_tokens=GPU.prompt_tokens, decode_tokens=GPU.decode_tokens,
                                       chunk=GPU.chunk, reps=args.reps, library_loops=True)  # fmt: skip
            elif piece == "tp":
                result = bench_tp(family, "tp8b", 2, "nccl", "bfloat16", args.reps, args.cache_dir)
            elif piece == "swap":
                path = install(family, args.size, "bfloat16", args.cache_dir)
                result = bench_swap(path, list(GPU.swap_lengths), 5, compare_mlx_lm=False)
            else:
                path = install(family, f"chat_{args.size}", "bfloat16", args.cache_dir)
                if piece == "interleaved":
                    result = bench_interleaved(path, GPU.chat)
                elif piece == "concurrency":
                    result = bench_concurrency(path, GPU.concurrency, args.out / "logs")
                else:
                    result = bench_servers(path, GPU.chat, args.out / "logs")
            emit(family, piece, result, started)


if __name__ == "__main__":
    main()
