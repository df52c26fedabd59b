"""A GPU run in pieces that each print (and save) their result as soon as they end.

A device lease is short and a killed process prints nothing, so unlike
``run.py`` this driver writes one JSON line per finished piece::

    python bench/gpu.py OUT_DIR [--family F ...] [--only forward|swap|interleaved|serving
|concurrency|server_step|step_cost|prefill_cost|constrain|draft|draft_round|experts
|steering|tp|batch_decode|graph_size|late_compiles] [--profile]

``constrain`` runs once (it is per vocabulary, not per family), and so does
``batch_decode``: qwen4_exp's batched decode against its row-by-row decode
on its ``large`` install (B = 8 and 16, 128- and 1024-token prompts: dense
and sparse QSA; :mod:`bench.batch_decode`). ``experts`` runs
for gemma4 only, on the ``moe_large`` install (``--size`` is for the other pieces).
``forward`` times both engines' hand loops and library loops, ours again with
compilation off (the uncompiled decode step), the fraction of the bandwidth
roofline each reaches and each step's graph size and host time
(:mod:`bench.decode_cost`). ``--profile`` also writes a cProfile of our
decode loop into ``OUT_DIR``, one text file per family.
``step_cost`` times the engine's batched decode step alone at B = 8 and 16
on the ``chat_{size}`` install (host CPU time against wall time per step,
and the top functions: :mod:`bench.step_cost`), then at B = 16 with 320
tokens held a row, about a chat server's (its step ran 2x the engine's at
24 on the H200: bench/README.md, fifteenth session). ``prefill_cost`` times one
batched prefill forward the first time its shape runs and again, then the
engine's phases synchronised, on the ``chat_{size}`` install
(:mod:`bench.prefill_cost`).
``server_step`` serves the ``chat_{size}`` install in process to 16 chat
clients and compares its decode step with the engine's step alone (thread
CPU times, where the time between steps goes, stack samples of the runner thread
and of the event loop: :mod:`bench.server_step`); ``concurrency`` runs it
too, after both servers, as a line of its own.
``late_compiles`` serves the ``chat_{size}`` install with empty compile
caches and lists the kernels compiled after ``serve`` said ready
(:mod:`bench.late_compiles`; none when the warm-up covered the traffic); run it
before ``concurrency``, whose first-use costs it does not warm.
``graph_size`` times both library loops under several sizes of MLX's CUDA
graphs, each in a process of its own (:mod:`bench.graph_size`).
``--only tp`` needs two GPUs (``nvidia-h200-x2``): TP=2 against TP=1 on the
~8B shape through NCCL (``bench/tp.py``), whatever ``--size`` says.
"""

from __future__ import annotations

import argparse
import os

# Before MLX loads: its CUDA GEMMs run float32 as TF32 by default while GEMVs
# (one token) stay full float32, so a k + 1-token verify and one-token steps of
# a float32 model disagree by TF32 rounding, which random-weight gemma4 turns
# into flipped argmaxes. bf16 pieces are unaffected.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.batch_decode import bench_batch_decode
from bench.common import install, machine, random_tokens
from bench.concurrency import bench_concurrency
from bench.constrain import bench_constrain
from bench.decode_cost import profile_decode
from bench.draft import MTP_FAMILIES, bench_draft
from bench.draft_round import profile as profile_round
from bench.experts import bench_experts
from bench.forward import bench_forward
from bench.graph_size import bench_graph_size
from bench.interleaved import bench_interleaved
from bench.late_compiles import measure as measure_late_compiles
from bench.prefill_cost import bench_prefill_cost
from bench.run import GPU
from bench.server_step import bench_server_step
from bench.serving import bench_servers
from bench.steering import bench_steering
from bench.step_cost import measure as measure_step
from bench.swap import bench_swap
from bench.tp import bench_tp
from turbospark.generation.runner import Runner


def server_step(path: Path) -> dict[str, object]:
    """:func:`bench_server_step` at 16 clients, sampled, in a child process
    killed after ``GPU.server_step_time_limit_s``: a failure or a timeout is
    this piece's result (``{"error": ...}``), never the end of the run."""
    try:
        return bench_server_step(path, 16, GPU.server_step, profile=True,
                                 time_limit_s=GPU.server_step_time_limit_s)  # fmt: skip
    except (TimeoutError, RuntimeError) as exc:
        return {"error": str(exc)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", action="append", choices=["gemma4", "qwen_gdn"])
    parser.add_argument(
        "--only",
        action="append",
        choices=[
            "forward",
            "swap",
            "interleaved",
            "serving",
            "concurrency",
            "server_step",
            "step_cost",
            "constrain",
            "draft",
            "draft_round",
            "experts",
            "steering",
            "tp",
            "batch_decode",
            "graph_size",
            "prefill_cost",
            "late_compiles",
        ],
    )
    parser.add_argument("--draft-depths", type=int, nargs="+", help="default 1-6")
    parser.add_argument("--draft-accuracies", type=float, nargs="+", help="default 1 .75 .5 .25 0")
    parser.add_argument("--graph-sizes", nargs="+", default=["default", "60", "200", "off"],
                        help="graph_size's settings (kernels a graph, default, off)")  # fmt: skip
    parser.add_argument("--graph-rounds", type=int, default=2, help="graph_size's rounds")
    parser.add_argument("--no-mtp", action="store_true",
                        help="draft without its MTP rows (a second install and its compiles)")  # fmt: skip
    parser.add_argument("--size", default="large")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/bench-cache"))
    parser.add_argument("--profile", action="store_true", help="cProfile our decode loop too")
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="concurrency: passed to turbospark serve"
    )
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
    if "constrain" in (args.only or []):
        started = time.perf_counter()
        emit("-", "constrain", bench_constrain(args.reps), started)
    if "batch_decode" in (args.only or []):
        started = time.perf_counter()
        size, batches, prompts, steps = GPU.batch_decode
        path = install("qwen4_exp", size, "bfloat16", args.cache_dir)
        result = bench_batch_decode(path, batches, prompts, steps, args.reps)
        emit("qwen4_exp", "batch_decode", result, started)
    once = ("constrain", "batch_decode")
    for family in args.family or ["gemma4", "qwen_gdn"]:
        for piece in [p for p in args.only or ["forward", "swap", "interleaved"] if p not in once]:
            started = time.perf_counter()
            if piece == "forward":
                path = install(family, args.size, "bfloat16", args.cache_dir)
                result = bench_forward(path, prompt_tokens=GPU.prompt_tokens, decode_tokens=GPU.decode_tokens,
                                       chunk=GPU.chunk, reps=args.reps, library_loops=True,
                                       uncompiled=True, cost=True)  # fmt: skip
                if args.profile:
                    runner = Runner.open(
                        path, context_length=GPU.prompt_tokens + GPU.decode_tokens + 2
                    )
                    prompt = random_tokens(GPU.prompt_tokens, runner.vocab_size, seed=2)
                    profile = profile_decode(runner, path, prompt, GPU.decode_tokens)
                    (args.out / f"profile-{family}.txt").write_text(profile)
            elif piece == "draft":
                # bf16, as the targets are stated: bench_draft replays a reference the
                # drafted path reproduces (fixed_point_reference), so the 100% oracle
                # accepts every draft even where a verify pass rounds unlike a step.
                path = install(family, args.size, "bfloat16", args.cache_dir)
                mtp = (install(family, args.size, "bfloat16", args.cache_dir, mtp=True)
                       if family in MTP_FAMILIES and not args.no_mtp else None)  # fmt: skip
                result = bench_draft(path, args.draft_depths or GPU.draft_depths,
                                     args.draft_accuracies or GPU.draft_accuracies,
                                     GPU.draft_tokens, args.reps, mtp)  # fmt: skip
            elif piece == "draft_round":
                # Where a depth-4 round's host and wall time go, against a plain step,
                # at 100% and 0% (bench/draft_round.py, here on the GPU's own sizes).
                result = profile_round(family, 4, GPU.draft_tokens, args.reps, (1.0, 0.0),
                                       args.cache_dir, size=args.size, dtype="bfloat16")  # fmt: skip
            elif piece == "experts":
                if family != "gemma4":
                    continue  # only gemma4 has an MoE block
                path = install(family, "moe_large", "bfloat16", args.cache_dir)
                result = bench_experts(path, prompt_tokens=64, decode_tokens=GPU.experts_decode,
                                       reps=args.reps)  # fmt: skip
            elif piece == "steering":
                path = install(family, args.size, "bfloat16", args.cache_dir)
                result = bench_steering(path, GPU.decode_tokens, args.reps)
            elif piece == "tp":
                result = bench_tp(family, "tp8b", 2, "nccl", "bfloat16", args.reps, args.cache_dir)
            elif piece == "graph_size":
                path = install(family, args.size, "bfloat16", args.cache_dir)
                result = bench_graph_size(path, args.graph_sizes, args.graph_rounds, args.reps)
            elif piece == "swap":
                path = install(family, args.size, "bfloat16", args.cache_dir)
                result = bench_swap(path, list(GPU.swap_lengths), 5, compare_mlx_lm=False)
            else:
                path = install(family, f"chat_{args.size}", "bfloat16", args.cache_dir)
                if piece == "interleaved":
                    result = bench_interleaved(path, GPU.chat)
                elif piece == "concurrency":
                    result = bench_concurrency(
                        path, GPU.concurrency, args.out / "logs", serve_args=args.serve_arg
                    )
                    emit(family, piece, result, started)
                    started, piece = time.perf_counter(), "server_step"
                    result = server_step(path)
                elif piece == "server_step":
                    result = server_step(path)
                elif piece == "prefill_cost":
                    result = bench_prefill_cost(path)
                elif piece == "late_compiles":
                    (args.out / "logs").mkdir(exist_ok=True)
                    log = args.out / "logs" / f"{path.name}-late-compiles.log"
                    result = measure_late_compiles(path, 16, log)
                elif piece == "step_cost":
                    result = [measure_step(path, b, 100, 0.0, profile=True) for b in (8, 16)]
                    # A server's rows hold a few hundred tokens: the same step at that history.
                    result.append(measure_step(path, 16, 100, 0.0, False, prompt_tokens=320))
                else:
                    result = bench_servers(path, GPU.chat, args.out / "logs")
            emit(family, piece, result, started)


if __name__ == "__main__":
    main()
