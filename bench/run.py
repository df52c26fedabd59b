"""Run every turbospark benchmark, print a table, write JSON and a plot.

    uv run python bench/run.py [--quick] [--json] [--family F ...] [--out DIR] [--save-reference]

Results go to ``bench/out/`` (untracked), so a run never dirties the checkout;
``--save-reference`` writes them to ``bench/results/`` instead, the committed
reference numbers that ``bench/README.md`` discusses.

Sections (``--only`` picks some): ``forward`` (prefill/decode tok/s against
mlx-lm on the same install), ``interleaved`` (K conversations round-robin,
pool against no pool, in process), ``serving`` (the same chats over HTTP,
``turbospark serve`` against ``mlx_lm.server``), ``concurrency`` (N clients
at once, each a multi-turn chat, against both servers), ``swap`` (swap cost against
history length, pool memory), ``dispatch`` (the hook path's per-token cost),
``server_step`` (the server's decode step against its engine's step alone,
on the host-bound ``chat_host`` shapes: :mod:`bench.server_step`),
``constrain`` (constrained decoding's per-token cost, llguidance against
xgrammar, on a 151,643-token vocabulary; once, not per family), ``draft``
(speculative decoding: tok/s against acceptance and depth, against off),
``experts`` (gemma4 only: the routed-expert cache's decode speed, hit rate and
memory against slot count), ``steering`` (decode with every layer steered
against steering off), ``batch_decode`` (qwen4_exp's batched decode against
its row-by-row decode, dense and sparse QSA; once, not per family:
:mod:`bench.batch_decode`).
Benchmarks never decide whether the test suite passes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so `bench.*` resolves.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.batch_decode import bench_batch_decode
from bench.batch_decode import summary as summary_batch
from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install, machine
from bench.concurrency import ConcurrencyPlan, bench_concurrency
from bench.constrain import bench_constrain
from bench.dispatch import bench_dispatch
from bench.draft import ACCURACIES, MTP_FAMILIES, bench_draft
from bench.experts import bench_experts
from bench.forward import bench_forward
from bench.interleaved import bench_interleaved
from bench.report import headline, print_constrain, print_table
from bench.server_step import bench_server_step
from bench.serving import bench_servers
from bench.steering import bench_steering
from bench.swap import bench_swap
from bench.workload import ChatWorkload

SECTIONS = (
    "forward", "interleaved", "serving", "concurrency", "server_step", "swap", "dispatch",
    "constrain", "draft", "experts", "steering", "batch_decode",
)  # fmt: skip
HERE = Path(__file__).resolve().parent
UNTRACKED = HERE / "out"  # gitignored
REFERENCE = HERE / "results"  # committed


SERVER_STEP = ConcurrencyPlan(clients=(16,))  # 16 clients, 3 turns, 64 tokens a reply


@dataclass(frozen=True)
class Plan:
    """How much of each benchmark to run: ``--quick`` fits in two minutes on two cores."""

    forward_sizes: tuple[str, ...]
    prompt_tokens: int
    decode_tokens: int
    chunk: int
    reps: int
    library_loops: bool
    chat: ChatWorkload
    swap_size: str
    swap_lengths: tuple[int, ...]
    swap_reps: int
    swap_vs_mlx_lm: bool
    dispatch_tokens: int
    concurrency: ConcurrencyPlan
    chat_size: str = "chat"
    draft_size: str = "small"
    draft_depths: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    draft_accuracies: tuple[float, ...] = ACCURACIES
    draft_tokens: int = 64
    experts_size: str = "moe"
    experts_decode: int = 32
    # bench/batch_decode.py on qwen4_exp: (size, batch sizes, prompt lengths, steps)
    batch_decode: tuple[str, tuple[int, ...], tuple[int, ...], int] = (
        "small",
        (4, 8),
        (32, 256),
        32,
    )
    # bench/server_step.py: clients (its one level), turns, reply tokens; the install size
    server_step: ConcurrencyPlan = SERVER_STEP
    server_step_size: str = "chat_host"
    server_step_time_limit_s: float = 600.0  # the child is killed past it (bench.server_step)


QUICK = Plan(
    forward_sizes=("small",),
    prompt_tokens=512,
    decode_tokens=32,
    chunk=256,
    reps=5,
    library_loops=True,
    chat=ChatWorkload(conversations=3, turns=4, user_chars=96, reply_chars=24, max_tokens=8),
    swap_size="tiny",
    swap_lengths=(1024, 4096, 16384),
    swap_reps=8,
    swap_vs_mlx_lm=False,
    dispatch_tokens=128,
    concurrency=ConcurrencyPlan(clients=(1, 8), reply_tokens=32),
    server_step=ConcurrencyPlan(clients=(8,), turns=2, reply_tokens=32),
    draft_depths=(1, 2, 4, 6),
    draft_accuracies=(1.0, 0.5, 0.0),
    draft_tokens=32,
    batch_decode=("small", (4,), (32, 256), 16),
)
FULL = Plan(
    forward_sizes=("small", "medium"),
    prompt_tokens=512,
    decode_tokens=32,
    chunk=256,
    reps=5,
    library_loops=True,
    chat=ChatWorkload(conversations=4, turns=6, user_chars=160, reply_chars=48, max_tokens=16),
    swap_size="small",
    swap_lengths=(1024, 4096, 16384),
    swap_reps=20,
    swap_vs_mlx_lm=True,
    dispatch_tokens=200,
    concurrency=ConcurrencyPlan(clients=(1, 8, 16)),
)
GPU = Plan(
    forward_sizes=("medium", "large"),
    prompt_tokens=2048,
    decode_tokens=128,
    chunk=512,
    reps=5,
    library_loops=True,
    chat=ChatWorkload(conversations=4, turns=6, user_chars=400, reply_chars=48, max_tokens=16),
    swap_size="large",
    swap_lengths=(1024, 4096, 16384),
    swap_reps=20,
    swap_vs_mlx_lm=True,
    dispatch_tokens=200,
    concurrency=ConcurrencyPlan(clients=(1, 16)),
    chat_size="chat_large",
    server_step_size="chat_large",
    server_step_time_limit_s=300.0,  # ~100 s expected on the H200
    draft_size="large",
    draft_tokens=128,
    experts_size="moe_large",
    experts_decode=128,
    batch_decode=("large", (8, 16), (128, 1024), 64),
)


def run_family(
    family: str, plan: Plan, sections: set[str], dtype: str, cache: Path, out: Path
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if "forward" in sections:
        result["forward"] = {
            size: bench_forward(
                install(family, size, dtype, cache),
                prompt_tokens=plan.prompt_tokens,
                decode_tokens=plan.decode_tokens,
                chunk=plan.chunk,
                reps=plan.reps,
                library_loops=plan.library_loops,
                uncompiled=True,
                cost=True,
            )
            for size in plan.forward_sizes
        }
    chat = install(family, plan.chat_size, dtype, cache)
    if "interleaved" in sections:
        result["interleaved"] = bench_interleaved(chat, plan.chat)
    if "serving" in sections:
        result["serving"] = bench_servers(chat, plan.chat, out / "logs")
    if "concurrency" in sections:
        result["concurrency"] = bench_concurrency(chat, plan.concurrency, out / "logs")
    if "server_step" in sections:
        plan_step = plan.server_step
        try:
            result["server_step"] = bench_server_step(
                install(family, plan.server_step_size, dtype, cache),
                plan_step.clients[0],
                plan_step,
                time_limit_s=plan.server_step_time_limit_s,
            )
        except (TimeoutError, RuntimeError) as exc:  # the other sections' results still count
            result["server_step"] = {"error": str(exc)}
    if "swap" in sections:
        result["swap"] = bench_swap(
            install(family, plan.swap_size, dtype, cache),
            list(plan.swap_lengths),
            plan.swap_reps,
            plan.swap_vs_mlx_lm,
        )
    if "dispatch" in sections:
        result["dispatch"] = bench_dispatch(
            install(family, "tiny", dtype, cache), plan.dispatch_tokens, plan.reps
        )
    if "draft" in sections:
        result["draft"] = bench_draft(
            install(family, plan.draft_size, dtype, cache),
            plan.draft_depths,
            plan.draft_accuracies,
            plan.draft_tokens,
            plan.reps if plan.reps < 5 else 3,
            install(family, plan.draft_size, dtype, cache, mtp=True)
            if family in MTP_FAMILIES
            else None,
        )
    if "experts" in sections and family == "gemma4":  # the family with an MoE block
        result["experts"] = bench_experts(
            install(family, plan.experts_size, dtype, cache),
            prompt_tokens=64,
            decode_tokens=plan.experts_decode,
            reps=plan.reps,
        )
    if "steering" in sections:
        result["steering"] = bench_steering(
            install(family, plan.forward_sizes[-1], dtype, cache), plan.decode_tokens, plan.reps
        )
    return {**headline(result), **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few reps (< 2 min)")
    parser.add_argument(
        "--gpu", action="store_true", help="medium and ~1B sizes, longer prompts (GPU runs)"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON result")
    parser.add_argument(
        "--family", action="append", choices=FAMILIES, help="repeatable; default all"
    )
    parser.add_argument("--only", action="append", choices=SECTIONS, help="repeatable; default all")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"results folder (default: {UNTRACKED})"
    )
    parser.add_argument(
        "--save-reference",
        action="store_true",
        help=f"write the committed reference results in {REFERENCE} (instead of --out)",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="synthetic installs")
    parser.add_argument(
        "--dtype", default=None, help="weights dtype (default: bf16 on GPU, f32 on CPU)"
    )
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.save_reference and args.out is not None:
        parser.error("--save-reference writes to bench/results/; drop --out")
    args.out = REFERENCE if args.save_reference else args.out or UNTRACKED

    mode = "quick" if args.quick else "gpu" if args.gpu else "full"
    plan = {"quick": QUICK, "gpu": GPU, "full": FULL}[mode]
    dtype = args.dtype or default_dtype()
    sections = set(args.only or SECTIONS)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "machine": machine(),
        "mode": mode,
        "dtype": dtype,
        "plan": asdict(plan),
        "families": {},
    }
    for family in args.family or FAMILIES:
        report["families"][family] = run_family(
            family, plan, sections, dtype, args.cache_dir, args.out
        )
    if "constrain" in sections:
        report["constrain"] = bench_constrain(plan.reps)
    if "batch_decode" in sections:
        size, batches, prompts, steps = plan.batch_decode
        path = install("qwen4_exp", size, dtype, args.cache_dir)
        report["batch_decode"] = bench_batch_decode(
            path, batches, prompts, steps, 1 if args.quick else 3
        )
    report["wall_s"] = time.perf_counter() - started

    stem = mode
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    if not args.no_plot:
        from bench.plot import plot

        plot(report, args.out / f"{stem}.png")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
        if "constrain" in report:
            print_constrain(report["constrain"])
        if "batch_decode" in report:
            print("\n== qwen4_exp batched decode against row by row", *summary_batch(report["batch_decode"]), sep="\n")  # fmt: skip
        print(
            f"\nwrote {args.out / (stem + '.json')}" + ("" if args.no_plot else f" and {stem}.png")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
