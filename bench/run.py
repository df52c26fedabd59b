"""The one entry point of turbospark's benchmarks, on the CPU or a GPU.

    uv run python -m bench.run --device cpu [--quick] [--family F ...] [--only S ...] [--save]
    python3 -m bench.run --device gpu [--only S ...] [--save]       # on a GPU machine

Every section writes its result as soon as it ends, one JSON file a section
and family (``forward_gemma4.json``; a section run once, ``constrain.json``;
``concurrency`` with ``--append-replies``, ``concurrency_replies_resent_gemma4.json``;
other chat shapes add theirs: :func:`result_name`),
with the machine record, the dtype and the plan beside it, and prints its
summary. A lease that ends mid-run keeps every section finished before.
Results go to ``bench/out/<device>/`` (git-ignored); ``--save`` writes the
committed reference results instead: ``bench/results/cpu/`` or
``bench/results/gpu/<card>/`` (``h100``, ``h200``). ``python -m bench.report
DIR`` prints a results folder again.

Sections, default all but ``tp`` and ``replicas`` (``--only`` picks):

- ``forward``: prefill and decode tok/s against mlx-lm on the same install
  (hand loop and both libraries' generation loops; roofline and host cost);
- ``interleaved``: K conversations round-robin in process, pool against no pool;
- ``serving``: the same chats over HTTP, ``turbospark serve`` against ``mlx_lm.server``;
- ``concurrency``: N clients at once, each a multi-turn chat, against both servers;
- ``startup``: launch to ready and to the first streamed token, against ``mlx_lm.server``;
- ``server_step``: the server's decode step against its engine's step alone;
- ``step_cost``: the engine's batched decode step alone, host against wall time;
- ``prefill_cost``: a batched prefill forward's first and second run, and the engine's phases;
  one prompt's prefill over a growing history against mlx-lm's ``generate_step``;
- ``host_cost`` (CPU): thread CPU time to build one decode step, ours against mlx-lm's;
- ``swap``: swap cost against history length, pool memory, against an mlx-lm cache hit;
- ``session_disk``: reloading a session from disk against prefilling it again;
- ``dispatch``: what the hook path and the runner add per token;
- ``draft``: speculative decoding's tok/s against acceptance and depth, against off;
- ``experts`` (gemma4): the routed-expert cache against slot count;
- ``steering``: decode with every layer steered against steering off;
- ``long_context``: long prompts against mlx-lm, each engine in a fresh process: decode
  tok/s, the slowest decode step over the median, the first 16 tokens, peak memory;
- ``quantized`` (gemma4, qwen_gdn): 8- and 4-bit conversions by ``mlx_lm.convert``
  against mlx-lm on the same directory: forward, memory, concurrency;
- ``constrain`` (once): llguidance against xgrammar per token;
- ``batch_decode`` (once, qwen4_exp): batched decode against row by row;
- ``tp`` (GPU, two cards): tensor parallel TP=2 against TP=1;
- ``replicas`` (CPU): two servers behind SGLang's gateway, ``cache_aware`` against ``round_robin``.

Benchmarks never decide whether the test suite passes.
"""

from __future__ import annotations

import os

# Before MLX loads: its CUDA GEMMs run float32 as TF32 by default while GEMVs
# (one token) stay full float32, so a k + 1-token verify and one-token steps of
# a float32 model disagree by TF32 rounding. bf16 (the GPU plan) is unaffected.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so `bench.*` resolves.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from bench.common import DEFAULT_CACHE, FAMILIES, install, machine
from bench.concurrency import ConcurrencyPlan
from bench.draft import ACCURACIES, MTP_FAMILIES
from bench.report import print_section
from bench.workload import ChatWorkload

SERVER_STEP = ConcurrencyPlan(clients=(16,))  # 16 clients, 3 turns, 64 tokens a reply
QUANTIZED_CONCURRENCY = ConcurrencyPlan(clients=(16,))
HERE = Path(__file__).resolve().parent
UNTRACKED = HERE / "out"  # gitignored
REFERENCE = HERE / "results"  # committed
ONCE = ("constrain", "batch_decode")  # per vocabulary / per qwen4_exp, not per family
EXTRA = ("tp", "replicas")  # only when named: two GPUs; sglang-router
CPU_ONLY = ("host_cost", "replicas")
GPU_ONLY = ("tp",)


@dataclass(frozen=True)
class Plan:
    """How much of each benchmark to run: ``--quick`` fits in a few minutes on two cores."""

    forward_sizes: tuple[str, ...]
    prompt_tokens: int
    decode_tokens: int
    chunk: int
    reps: int
    chat: ChatWorkload
    swap_size: str
    swap_lengths: tuple[int, ...]
    swap_reps: int
    swap_vs_mlx_lm: bool
    dispatch_tokens: int
    concurrency: ConcurrencyPlan
    dtype: str = "float32"  # MLX's CPU bf16 matmul has no BLAS path; gather_mm wants f32
    chat_size: str = "chat"
    draft_size: str = "small"
    draft_depths: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    draft_accuracies: tuple[float, ...] = ACCURACIES
    draft_tokens: int = 64
    draft_reps: int = 3
    experts_size: str = "moe"
    experts_decode: int = 32
    steering_size: str = "medium"
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
    step_cost_size: str = "chat"
    step_cost_batches: tuple[int, ...] = (8, 16)
    step_cost_steps: int = 100
    prefill_cost_size: str = "chat_host"
    # bench/prefill_cost.py's held comparison: a 4-layer and a 16-layer size
    prefill_held_sizes: tuple[str, ...] = ("chat", "chat_host")
    session_disk_size: str = "small"
    session_disk_lengths: tuple[int, ...] = (1024, 4096, 16384)
    host_cost_steps: int = 100
    host_cost_rounds: int = 3
    # bench/quantized.py: sizes converted to 8 and 4 bits; the first also runs
    # the concurrency plan on each conversion
    quantized_sizes: tuple[str, ...] = ("small",)
    quantized_concurrency: ConcurrencyPlan | None = QUANTIZED_CONCURRENCY
    quantized_bits: tuple[int, ...] = (8, 4)
    startup_reps: int = 5  # bench/startup.py: cold launches of each server
    # MLX's buffer cache limit for both servers of the HTTP sections (serving,
    # concurrency, startup, quantized's concurrency), through bench/capped.py.
    # None: MLX's own, its memory limit; two servers on one GPU would each take
    # the whole device for freed buffers and the second would run out.
    server_cache_limit: str | None = None
    # bench/long_context.py: the install size, prompt lengths, decode tokens
    long_context_size: str = "small"
    long_context_lengths: tuple[int, ...] = (1024, 4096)
    long_context_decode: int = 64
    # Flags the concurrency section passes to `turbospark serve` after its own
    # (an A/B of a server setting: --serve-arg=--cuda-graphs=off); in its result's settings.
    serve_args: tuple[str, ...] = ()


QUICK = Plan(
    forward_sizes=("small",),
    prompt_tokens=512,
    decode_tokens=32,
    chunk=256,
    reps=5,
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
    draft_reps=2,
    steering_size="small",
    batch_decode=("small", (4,), (32, 256), 16),
    step_cost_batches=(8,),
    step_cost_steps=30,
    session_disk_size="tiny",
    session_disk_lengths=(1024, 4096),
    host_cost_steps=30,
    host_cost_rounds=1,
    quantized_concurrency=None,
    startup_reps=2,
    long_context_lengths=(1024,),
    long_context_decode=32,
)
CPU = Plan(
    forward_sizes=("small", "medium"),
    prompt_tokens=512,
    decode_tokens=32,
    chunk=256,
    reps=5,
    chat=ChatWorkload(conversations=4, turns=6, user_chars=160, reply_chars=48, max_tokens=16),
    swap_size="small",
    swap_lengths=(1024, 4096, 16384),
    swap_reps=20,
    swap_vs_mlx_lm=True,
    dispatch_tokens=200,
    concurrency=ConcurrencyPlan(clients=(1, 8, 16)),
)
GPU = Plan(
    forward_sizes=("large",),
    prompt_tokens=2048,
    decode_tokens=128,
    chunk=512,
    reps=3,
    chat=ChatWorkload(conversations=4, turns=6, user_chars=400, reply_chars=48, max_tokens=16),
    swap_size="large",
    swap_lengths=(1024, 4096, 16384),
    swap_reps=5,
    swap_vs_mlx_lm=True,
    dispatch_tokens=200,
    concurrency=ConcurrencyPlan(clients=(1, 16)),
    dtype="bfloat16",
    chat_size="chat_large",
    server_step_size="chat_large",
    server_step_time_limit_s=300.0,
    draft_size="large",
    draft_tokens=128,
    experts_size="moe_large",
    experts_decode=128,
    steering_size="large",
    batch_decode=("large", (8, 16), (128, 1024), 64),
    step_cost_size="chat_large",
    prefill_cost_size="chat_large",
    prefill_held_sizes=("chat_large",),
    session_disk_size="large",
    quantized_sizes=("large", "tp8b"),
    quantized_concurrency=None,  # a lease's command is too short for both servers a width
    startup_reps=3,
    server_cache_limit="8GiB",  # each server: weights and sessions, plus 8 GiB of freed buffers
    long_context_size="large",
    long_context_lengths=(4096, 16384, 32768),
    long_context_decode=128,
)
SECTIONS = (
    "forward", "interleaved", "serving", "concurrency", "startup", "server_step", "step_cost",
    "prefill_cost", "host_cost", "swap", "session_disk", "dispatch", "draft", "experts",
    "steering", "long_context", "quantized", "constrain", "batch_decode", "tp", "replicas",
)  # fmt: skip


@dataclass(frozen=True)
class Context:
    plan: Plan
    cache: Path
    logs: Path
    quick: bool

    def install(self, family: str, size: str, mtp: bool = False) -> Path:
        return install(family, size, self.plan.dtype, self.cache, mtp=mtp)


def _forward(ctx: Context, family: str) -> dict[str, Any]:
    from bench.forward import bench_forward

    p = ctx.plan
    return {
        size: bench_forward(
            ctx.install(family, size),
            prompt_tokens=p.prompt_tokens,
            decode_tokens=p.decode_tokens,
            chunk=p.chunk,
            reps=p.reps,
            library_loops=True,
            uncompiled=True,
            cost=True,
        )
        for size in p.forward_sizes
    }


def _interleaved(ctx: Context, family: str) -> dict[str, Any]:
    from bench.interleaved import bench_interleaved

    return bench_interleaved(ctx.install(family, ctx.plan.chat_size), ctx.plan.chat)


def _serving(ctx: Context, family: str) -> dict[str, Any]:
    from bench.serving import bench_servers

    p = ctx.plan
    return bench_servers(ctx.install(family, p.chat_size), p.chat, ctx.logs, p.server_cache_limit)


def _concurrency(ctx: Context, family: str) -> dict[str, Any]:
    from bench.concurrency import bench_concurrency

    p = ctx.plan
    path = ctx.install(family, p.chat_size)
    return bench_concurrency(
        path, p.concurrency, ctx.logs, serve_args=p.serve_args, cache_limit=p.server_cache_limit
    )


def _startup(ctx: Context, family: str) -> dict[str, Any]:
    from bench.startup import bench_startup

    path = ctx.install(family, ctx.plan.chat_size)
    return bench_startup(path, ctx.plan.startup_reps, ctx.logs, ctx.plan.server_cache_limit)


def _server_step(ctx: Context, family: str) -> dict[str, Any]:
    from bench.server_step import bench_server_step

    p = ctx.plan
    try:
        return bench_server_step(
            ctx.install(family, p.server_step_size),
            p.server_step.clients[0],
            p.server_step,
            time_limit_s=p.server_step_time_limit_s,
        )
    except (TimeoutError, RuntimeError) as exc:  # the other sections' results still count
        return {"error": str(exc)}


def _step_cost(ctx: Context, family: str) -> dict[str, Any]:
    from bench.step_cost import measure, mlx_lm_step

    p = ctx.plan
    path = ctx.install(family, p.step_cost_size)
    rows = []
    for batch in p.step_cost_batches:  # ours, then mlx-lm's BatchGenerator on the same prompts
        ours = measure(path, batch, p.step_cost_steps, 0.0, False)
        theirs = mlx_lm_step(path, batch, p.step_cost_steps, ours["vocab"])
        ratio = theirs["wall_ms_per_step"] / ours["wall_ms_per_step"]
        rows.append({**ours, "mlx_lm": theirs, "wall_ratio_vs_mlx_lm": ratio})
    return {"rows": rows}


def _prefill_cost(ctx: Context, family: str) -> dict[str, Any]:
    from bench.prefill_cost import bench_prefill_cost

    held = {size: ctx.install(family, size) for size in ctx.plan.prefill_held_sizes}
    return bench_prefill_cost(ctx.install(family, ctx.plan.prefill_cost_size), held)


def _host_cost(ctx: Context, family: str) -> dict[str, Any]:
    from bench.host_cost import host_cost

    p = ctx.plan
    return host_cost(family, p.host_cost_steps, p.host_cost_rounds, ctx.cache)


def _swap(ctx: Context, family: str) -> dict[str, Any]:
    from bench.swap import bench_swap

    p = ctx.plan
    path = ctx.install(family, p.swap_size)
    return bench_swap(path, list(p.swap_lengths), p.swap_reps, p.swap_vs_mlx_lm)


def _session_disk(ctx: Context, family: str) -> dict[str, Any]:
    from bench.session_disk import bench_session_disk

    p = ctx.plan
    path = ctx.install(family, p.session_disk_size)
    return bench_session_disk(path, list(p.session_disk_lengths), 1 if ctx.quick else 3)


def _dispatch(ctx: Context, family: str) -> dict[str, Any]:
    from bench.dispatch import bench_dispatch

    p = ctx.plan
    return bench_dispatch(ctx.install(family, "tiny"), p.dispatch_tokens, p.reps)


def _draft(ctx: Context, family: str) -> dict[str, Any]:
    from bench.draft import bench_draft

    p = ctx.plan
    mtp = ctx.install(family, p.draft_size, mtp=True) if family in MTP_FAMILIES else None
    return bench_draft(
        ctx.install(family, p.draft_size),
        p.draft_depths,
        p.draft_accuracies,
        p.draft_tokens,
        p.draft_reps,
        mtp,
    )


def _experts(ctx: Context, family: str) -> dict[str, Any] | None:
    from bench.experts import bench_experts

    if family != "gemma4":  # the family with an MoE block
        return None
    p = ctx.plan
    path = ctx.install(family, p.experts_size)
    return bench_experts(path, prompt_tokens=64, decode_tokens=p.experts_decode, reps=p.reps)


def _steering(ctx: Context, family: str) -> dict[str, Any]:
    from bench.steering import bench_steering

    p = ctx.plan
    return bench_steering(ctx.install(family, p.steering_size), p.decode_tokens, p.reps)


def _quantized(ctx: Context, family: str) -> dict[str, Any] | None:
    from bench.quantized import bench_quantized

    if family not in ("gemma4", "qwen_gdn"):  # the families mlx-lm converts
        return None
    p = ctx.plan
    return {
        size: bench_quantized(
            ctx.install(family, size),
            prompt_tokens=p.prompt_tokens,
            decode_tokens=p.decode_tokens,
            chunk=p.chunk,
            reps=p.reps,
            log_dir=ctx.logs / "quantized",
            concurrency=p.quantized_concurrency if i == 0 else None,
            bits=p.quantized_bits,
            cache_limit=p.server_cache_limit,
        )
        for i, size in enumerate(p.quantized_sizes)
    }


def _long_context(ctx: Context, family: str) -> dict[str, Any]:
    from bench.long_context import bench_long_context

    p = ctx.plan
    return bench_long_context(
        ctx.install(family, p.long_context_size),
        prompt_lengths=p.long_context_lengths,
        decode_tokens=p.long_context_decode,
        chunk=p.chunk,
    )


def _constrain(ctx: Context, family: str) -> dict[str, Any]:
    from bench.constrain import bench_constrain

    return bench_constrain(ctx.plan.reps)


def _batch_decode(ctx: Context, family: str) -> dict[str, Any]:
    from bench.batch_decode import bench_batch_decode

    size, batches, prompts, steps = ctx.plan.batch_decode
    path = ctx.install("qwen4_exp", size)
    return bench_batch_decode(path, batches, prompts, steps, 1 if ctx.quick else 3)


def _tp(ctx: Context, family: str) -> dict[str, Any]:
    from bench.tp import bench_tp

    return bench_tp(family, "tp8b", 2, "nccl", "bfloat16", ctx.plan.reps, ctx.cache)


def _replicas(ctx: Context, family: str) -> dict[str, Any]:
    from bench.replicas import WORKLOAD, bench_replicas

    return bench_replicas(ctx.install(family, ctx.plan.chat_size), WORKLOAD, ctx.logs)


RUN: dict[str, Callable[[Context, str], dict[str, Any] | None]] = {
    "forward": _forward, "interleaved": _interleaved, "serving": _serving,
    "concurrency": _concurrency, "startup": _startup, "server_step": _server_step,
    "step_cost": _step_cost,
    "prefill_cost": _prefill_cost, "host_cost": _host_cost, "swap": _swap,
    "session_disk": _session_disk, "dispatch": _dispatch, "draft": _draft,
    "experts": _experts, "steering": _steering, "long_context": _long_context,
    "quantized": _quantized,
    "constrain": _constrain,
    "batch_decode": _batch_decode, "tp": _tp, "replicas": _replicas,
}  # fmt: skip


def card() -> str:
    """``h100``, ``h200``, ... from the GPU's name; ``gpu`` if MLX does not say."""
    name = str(mx.device_info().get("device_name", "")).lower()
    return next((c for c in ("h100", "h200", "b200", "a100", "l40s") if c in name), "gpu")


def results_dir(device: str) -> Path:
    return REFERENCE / "cpu" if device == "cpu" else REFERENCE / "gpu" / card()


def result_name(section: str, family: str, concurrency: ConcurrencyPlan | None = None) -> str:
    """The section's file. The concurrency section re-sending replies as
    received (``--append-replies``) has its own, beside the fixed-text one,
    and chats of other turns or reply lengths than the default 3 x 64
    (``--concurrency-turns``, ``--concurrency-reply-tokens``) theirs:
    ``concurrency_replies_resent_2x256_gemma4.json``."""
    if section == "concurrency" and concurrency is not None:
        if concurrency.append_replies:
            section += "_replies_resent"
        shape = (concurrency.turns, concurrency.reply_tokens)
        if shape != (ConcurrencyPlan.turns, ConcurrencyPlan.reply_tokens):
            section += f"_{shape[0]}x{shape[1]}"
    return f"{section}.json" if section in ONCE else f"{section}_{family}.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "gpu"), required=True)
    parser.add_argument("--quick", action="store_true", help="CPU: tiny and small sizes, few reps")
    parser.add_argument(
        "--family", action="append", choices=FAMILIES, help="repeatable; default all"
    )
    parser.add_argument("--only", action="append", choices=SECTIONS, help="repeatable")
    parser.add_argument("--out", type=Path, help="results folder (default bench/out/<device>)")
    parser.add_argument(
        "--save", action="store_true", help="write the committed reference results instead"
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="synthetic installs")
    parser.add_argument(
        "--quantized-bits",
        type=int,
        action="append",
        choices=(4, 8),
        help="repeatable: the widths the quantized section converts to (default 8 and 4)",
    )
    parser.add_argument(
        "--quantized-size",
        action="append",
        help="repeatable: the sizes the quantized section converts (default: the plan's)",
    )
    parser.add_argument(
        "--concurrency-clients",
        type=int,
        action="append",
        help="repeatable: the concurrency section's client counts (default: the plan's)",
    )
    parser.add_argument(
        "--append-replies",
        action="store_true",
        help="concurrency: each turn appends the reply as the client received it",
    )
    parser.add_argument(
        "--concurrency-turns",
        type=int,
        help="concurrency: turns a chat (default: the plan's, 3)",
    )
    parser.add_argument(
        "--concurrency-reply-tokens",
        type=int,
        help="concurrency: tokens a reply (default: the plan's, 64)",
    )
    parser.add_argument(
        "--concurrency-reps",
        type=int,
        help="concurrency: repetitions of each level, for the ratio's spread (default: the plan's)",
    )
    parser.add_argument(
        "--long-context-length",
        type=int,
        action="append",
        metavar="TOKENS",
        help="repeatable: the long_context section's prompt lengths (default: the plan's); "
        "a GPU command that cannot run them all can run one",
    )
    parser.add_argument(
        "--startup-reps",
        type=int,
        help="startup: cold launches of each server (default: the plan's)",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="repeatable: passed to our server in the concurrency section, after the bench's "
        "own flags, and recorded in its settings (e.g. --serve-arg=--cuda-graphs=off)",
    )
    parser.add_argument(
        "--quantized-clients",
        type=int,
        action="append",
        help="repeatable: client counts the quantized section's first size runs both servers "
        "at (default: the plan's; 0: none)",
    )
    args = parser.parse_args(argv)
    if args.save and (args.out or args.quick):
        parser.error("--save writes the full plan to bench/results/; drop --out and --quick")
    if args.device == "gpu" and args.quick:
        parser.error("--quick is a CPU plan")
    if args.device == "cpu":
        mx.set_default_device(mx.cpu)
    elif mx.default_device() != mx.gpu:
        parser.error("--device gpu: MLX has no GPU here (mlx-cuda-13 on Linux)")

    plan = QUICK if args.quick else CPU if args.device == "cpu" else GPU
    if args.quantized_size:
        plan = replace(plan, quantized_sizes=tuple(args.quantized_size))
    if args.quantized_bits:
        plan = replace(plan, quantized_bits=tuple(args.quantized_bits))
    for name in (
        "concurrency_turns",
        "concurrency_reply_tokens",
        "concurrency_reps",
        "startup_reps",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(n < 1 for n in args.long_context_length or ()):
        parser.error("--long-context-length must be at least 1 (a prompt of that many tokens)")
    if args.long_context_length:
        plan = replace(plan, long_context_lengths=tuple(args.long_context_length))
    if args.startup_reps:
        plan = replace(plan, startup_reps=args.startup_reps)
    if args.serve_arg:
        plan = replace(plan, serve_args=tuple(args.serve_arg))
    if (
        args.concurrency_clients
        or args.append_replies
        or args.concurrency_reps
        or args.concurrency_turns
        or args.concurrency_reply_tokens
    ):
        clients = tuple(args.concurrency_clients or plan.concurrency.clients)
        plan = replace(
            plan,
            concurrency=replace(
                plan.concurrency,
                clients=clients,
                append_replies=args.append_replies,
                reps=args.concurrency_reps or plan.concurrency.reps,
                turns=args.concurrency_turns or plan.concurrency.turns,
                reply_tokens=args.concurrency_reply_tokens or plan.concurrency.reply_tokens,
            ),
        )
    if args.quantized_clients:
        clients = tuple(n for n in args.quantized_clients if n > 0)
        plan = replace(
            plan, quantized_concurrency=ConcurrencyPlan(clients=clients) if clients else None
        )
    wrong = CPU_ONLY if args.device == "gpu" else GPU_ONLY
    sections = [
        s for s in SECTIONS
        if (s in args.only if args.only else s not in EXTRA) and s not in wrong
    ]  # fmt: skip
    out = results_dir(args.device) if args.save else args.out or UNTRACKED / args.device
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(plan, args.cache_dir, UNTRACKED / "logs", args.quick)
    record = {
        "machine": machine(),
        "dtype": plan.dtype,
        "plan": "quick" if args.quick else args.device,
    }
    print(json.dumps(record["machine"]))
    for section in sections:
        families = ["-"] if section in ONCE else args.family or list(FAMILIES)
        for family in families:
            started = time.perf_counter()
            result = RUN[section](ctx, family)
            if result is None:
                continue
            seconds = time.perf_counter() - started
            row = {"section": section, "family": family, **record, "seconds": seconds}
            row["plan_settings"] = asdict(plan)
            row["result"] = result
            path = out / result_name(section, family, plan.concurrency)
            path.write_text(json.dumps(row, indent=1) + "\n")
            print_section(section, family, result)
            print(f"  ({seconds:.0f} s) -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
