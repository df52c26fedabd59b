"""``turbospark serve MODEL``: the OpenAI-compatible server on one model (an
install, a checkpoint directory or a hub id)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from turbospark.commands import (
    MODEL_HELP,
    add_draft_flags,
    add_expert_cache_flag,
    add_kv_cache_flags,
    add_pool_memory_flag,
    byte_size,
    draft_policy,
    kv_cache_options,
    model_text,
)
from turbospark.commands.steer import add_steering_args, steering_policy
from turbospark.errors import InvalidInput
from turbospark.server.response_store import ResponseStoreLimits
from turbospark.server.settings import PREFILL_GATHER_S, ServerLimits

if TYPE_CHECKING:  # the heavy modules load in run(), so `turbospark --help` stays light
    from turbospark.generation.distributed import Lockstep
    from turbospark.generation.runner import Runner
    from turbospark.server.worker import RunnerWorker
    from turbospark.text import TextCodec

DEFAULT_MAX_TOKENS = 2048
DEFAULT_MAX_BATCH = 8
# Prompt tokens prefilled per engine step, all waiting prompts together, as
# mlx_lm.server's --prefill-step-size: prompts that arrive together go in
# fewer, larger batched forwards. Against a bound of one chunk (512) it gives
# the same throughput within the spread, on the H200 and on the CPU, and a
# lower TTFT p50 on the CPU.
DEFAULT_PREFILL_BUDGET = 2048


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API (chat/completions, completions, models)",
        description="Serve MODEL (an install, a checkpoint directory or a Hugging Face hub id) "
        "on an OpenAI-compatible HTTP API. "
        "Conversations are matched to sessions by token content: with --session-slots N, "
        "up to N conversations stay warm at once.",
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--session-slots", type=int, default=1, help="conversations kept warm")
    add_pool_memory_flag(parser)
    parser.add_argument(
        "--mlx-cache-limit",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="bound on MLX's cache of freed buffers kept for reuse (e.g. 8GiB; 0 keeps none). "
        "MLX's own bound is its memory limit, about the whole device, and batch shapes that "
        "change every step can fill it; bound it to share the device with another process "
        "(default: MLX's own)",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("on", "off"),
        default=None,
        help="whether MLX's CUDA backend launches a step's kernels as CUDA graphs "
        "(MLX_USE_CUDA_GRAPHS). MLX captures each cuBLASLt product of a batched step into its "
        "graph anew; off launches every kernel directly. Nothing changes on the CPU or Metal "
        "(default: MLX's own, on)",
    )
    add_expert_cache_flag(parser)
    add_kv_cache_flags(parser)
    parser.add_argument(
        "--session-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep sessions on disk: those leaving memory are written here instead of dropped, "
        "the live one after every request, and a restart finds them all again",
    )
    parser.add_argument(
        "--max-session-disk",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="bound on --session-dir (e.g. 20GiB): the least recently used files are deleted "
        "to fit (default: unbounded)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument(
        "--chunk-size", type=int, default=512, help="prefill tokens per forward, per request"
    )
    parser.add_argument(
        "--prefill-gather-ms",
        type=float,
        default=PREFILL_GATHER_S * 1000,
        metavar="MS",
        help="the longest a queued prompt waits for requests the server is still preparing "
        "(rendering, tokenizing), so that a burst of requests prefills in one forward; 0 "
        f"admits each at once (default {PREFILL_GATHER_S * 1000:g}; not under --distributed)",
    )
    parser.add_argument(
        "--prefill-budget",
        type=int,
        default=DEFAULT_PREFILL_BUDGET,
        metavar="TOKENS",
        help="prompt tokens prefilled per step, all waiting requests together; decoding "
        "requests wait for that step, so less smooths their pace and more takes a burst of "
        f"prompts in fewer forwards (default {DEFAULT_PREFILL_BUDGET}, as mlx_lm.server's "
        "--prefill-step-size)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="max_tokens for a request that omits it (every request also stops at the "
        f"context length; default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--context-overflow",
        choices=("refuse", "drop-turns"),
        default="refuse",
        help="a chat past the context length: refuse it with a 400 (default), or drop its "
        "oldest turns (never the system prompt, never half a tool exchange) until it fits "
        "with room for max_tokens",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help="requests decoded together in one forward; more wait in arrival order "
        f"(default {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--no-warm-up",
        action="store_true",
        help="skip the warm-up: prefill and decode run once at start, so that later requests "
        "find their paths built (a request that comes during it cuts it short)",
    )
    parser.add_argument(
        "--no-prefix-reuse", action="store_true", help="prefill every prompt from scratch"
    )
    add_draft_flags(parser)
    parser.add_argument("--model-id", help="the served model name (default: the manifest's)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TURBOSPARK_API_KEY"),
        metavar="KEY",
        help="require this key ('Authorization: Bearer KEY' or 'x-api-key') on /v1/* and the "
        "sessions view; /health and the page stay open (default: $TURBOSPARK_API_KEY, else none)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browsers on this origin (e.g. https://app.example.com) call the API; repeatable",
    )
    defaults = ServerLimits()
    parser.add_argument(
        "--max-request-bytes",
        type=byte_size,
        default=defaults.max_request_bytes,
        metavar="SIZE",
        help="refuse larger request bodies with 413 before reading them (default: 16MiB)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=defaults.max_queue,
        metavar="N",
        help="generation requests admitted at once, running or waiting; beyond it 503 "
        f"with Retry-After (default: {defaults.max_queue})",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout,
        metavar="SECONDS",
        help="deadline from a request's arrival to its last byte; past it the request ends "
        f"with a request_timeout error and its generation stops (default: {defaults.request_timeout:g})",
    )
    parser.add_argument(
        "--send-timeout",
        type=float,
        default=defaults.send_timeout,
        metavar="SECONDS",
        help="how long a reply may wait on a client that reads nothing; past it the reply is "
        f"abandoned and its generation stops (default: {defaults.send_timeout:g})",
    )
    stored = ResponseStoreLimits()
    parser.add_argument(
        "--max-stored-responses",
        type=int,
        default=stored.max_count,
        metavar="N",
        help="stored Responses API responses kept for previous_response_id, least recently "
        f"used first out (0: store none; default: {stored.max_count})",
    )
    parser.add_argument(
        "--response-store-memory",
        type=byte_size,
        default=stored.max_bytes,
        metavar="SIZE",
        help="bytes the stored responses' items may hold (default: 64MiB)",
    )
    parser.add_argument(
        "--response-ttl",
        type=float,
        default=stored.max_age,
        metavar="SECONDS",
        help=f"how long a stored response is kept (default: {stored.max_age:g}, a week)",
    )
    add_steering_args(parser)
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="shard the model across the processes of `mlx.launch -n N --backend ring|nccl -- "
        "python -m turbospark serve ...` (tensor parallelism): rank 0 serves HTTP and every "
        "rank runs the same steps (docs/SCALING.md)",
    )
    parser.add_argument(
        "--distributed-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="with --distributed: a rank that hears nothing from the group this long (a peer "
        "hung) exits with an error, as do the others (default: 120)",
    )
    parser.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> None:
    """Refuse contradictory flags before anything is loaded."""
    draft_policy(args)  # a depth below 1 is refused by name
    if args.no_prefix_reuse and args.session_slots > 1:
        raise InvalidInput(
            f"--session-slots {args.session_slots} with --no-prefix-reuse would keep "
            f"{args.session_slots - 1} parked session(s) that nothing can ever resume: sessions "
            "are found by prefix reuse; drop --no-prefix-reuse or use --session-slots 1"
        )
    if args.max_session_disk is not None and args.session_dir is None:
        raise InvalidInput("--max-session-disk bounds --session-dir; pass --session-dir DIR too")
    if args.session_dir is not None and args.session_slots < 2:
        raise InvalidInput(
            f"--session-dir extends the session pool, but --session-slots is "
            f"{args.session_slots}; use --session-slots 2 or more"
        )
    if args.max_stored_responses < 0:
        raise InvalidInput(
            f"--max-stored-responses must be 0 or more, got {args.max_stored_responses}"
        )
    if args.chunk_size <= 0:
        raise InvalidInput(f"--chunk-size must be positive, got {args.chunk_size}")
    if args.prefill_budget <= 0:
        raise InvalidInput(f"--prefill-budget must be positive, got {args.prefill_budget}")
    if not args.prefill_gather_ms >= 0:  # NaN too
        raise InvalidInput(f"--prefill-gather-ms must be 0 or more, got {args.prefill_gather_ms:g}")
    if args.max_batch < 1:
        raise InvalidInput(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise InvalidInput(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.distributed and args.draft != "off":
        raise InvalidInput(
            f"--draft {args.draft} with --distributed: a draft round's acceptance is not yet "
            "carried between ranks; drop --draft (or run replicas instead, docs/SCALING.md)"
        )
    if args.distributed and args.session_dir is not None:
        raise InvalidInput(
            "--session-dir with --distributed: each rank holds only its shard of a session and "
            "the disk tier's files hold whole ones; drop --session-dir, or run replicas instead "
            "(docs/SCALING.md)"
        )
    if args.mlx_cache_limit is not None and args.mlx_cache_limit >= 1 << 63:
        raise InvalidInput(
            f"--mlx-cache-limit {args.mlx_cache_limit} bytes is past what MLX can hold (2^63); "
            "use a size the device has, e.g. 8GiB"
        )
    for flag, value in [
        ("--max-request-bytes", args.max_request_bytes),
        ("--max-queue", args.max_queue),
        ("--request-timeout", args.request_timeout),
        ("--send-timeout", args.send_timeout),
        ("--distributed-timeout", args.distributed_timeout),
        ("--response-store-memory", args.response_store_memory),
        ("--response-ttl", args.response_ttl),
    ]:
        if value <= 0:
            raise InvalidInput(f"{flag} must be positive, got {value:g}")


def limits_of(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        send_timeout=args.send_timeout,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from turbospark.generation.runner import Runner
    from turbospark.loading.quantization import quantization_of, summary
    from turbospark.policies import ExpertCacheSlots
    from turbospark.server.app import create_app
    from turbospark.server.worker import RunnerWorker

    check_args(args)
    if args.cuda_graphs is not None:  # MLX reads it once, at its first launch
        os.environ["MLX_USE_CUDA_GRAPHS"] = "1" if args.cuda_graphs == "on" else "0"
    if args.mlx_cache_limit is not None:  # before any weight is read, so loading obeys it too
        import mlx.core as mx

        mx.set_cache_limit(args.mlx_cache_limit)
    steering = steering_policy(args)
    lockstep = join_group(args) if args.distributed else None
    source, codec = model_text(args.model)
    worker = RunnerWorker()

    def open_runner() -> Runner:
        runner = Runner.open(
            source,
            group=None if lockstep is None else lockstep.group,
            context_length=args.context_length,
            session_slots=args.session_slots,
            max_parked_bytes=args.max_parked_memory,
            session_dir=args.session_dir,
            max_session_disk_bytes=args.max_session_disk,
            draft=draft_policy(args),
            expert_cache=ExpertCacheSlots.parse(args.expert_cache_slots),
            steering=steering,
            **kv_cache_options(args),
        )
        runner.set_prefix_reuse(not args.no_prefix_reuse)
        return runner

    runner = worker.run(open_runner)  # MLX work stays on the worker thread
    # One full prefill chunk plus its last token, then decoding alone and batched.
    warm_up = None if args.no_warm_up else [0] * min(args.chunk_size + 1, args.context_length - 4)
    if lockstep is not None and not lockstep.leader:
        return follow(args, runner, codec, worker, lockstep, warm_up)
    app = create_app(
        runner,
        codec,
        model_id=args.model_id,
        chunk_size=args.chunk_size,
        prefill_budget=args.prefill_budget,
        gather_s=args.prefill_gather_ms / 1000,
        default_max_tokens=args.max_tokens,
        worker=worker,
        max_batch=args.max_batch,
        warm_up=warm_up,
        limits=limits_of(args),
        api_key=args.api_key,
        cors_origins=args.cors_origin,
        lockstep=lockstep,
        context_overflow=args.context_overflow,
        response_store=ResponseStoreLimits(
            max_count=args.max_stored_responses,
            max_bytes=args.response_store_memory,
            max_age=args.response_ttl,
        ),
    )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    disk = runner.session_disk
    on_disk = "" if disk is None else (
        f", {len(disk.entries)} session(s) on disk in {disk.root}"
        + (f" ({len(disk.rejected)} refused, moved to rejected/)" if disk.rejected else "")
    )  # fmt: skip
    ranks = "" if lockstep is None else f" sharded across {lockstep.group.size()} processes,"
    cache = "" if args.mlx_cache_limit is None else (
        f", MLX's buffer cache bounded to {args.mlx_cache_limit / (1 << 30):.3g} GiB"
    )  # fmt: skip
    graphs = "" if args.cuda_graphs is None else f", CUDA graphs {args.cuda_graphs}"
    # The packing actually loaded (not the config's claim): what the tensors were read as.
    quantized = summary(quantization_of(runner.model))
    packing = runner.manifest.dtype + ("" if quantized is None else f", {quantized}")
    print(
        f"serving {args.model_id or runner.manifest.model_id} ({runner.manifest.family}, "
        f"{packing}, {source.describe()}) on "
        f"http://{args.host}:{args.port}/v1 with {runner.session_pool_size} session slot(s)"
        f"{on_disk},{ranks} up to {args.max_batch} request(s) per batch{cache}{graphs}; "
        f"the page is at http://{args.host}:{args.port}/",
        flush=True,
    )
    config = limits_of(args).uvicorn_config(app, host=args.host, port=args.port, log_level="info")
    uvicorn.Server(config).run()
    return 0  # cli.run leaves without finalizing (the ring backend's threads would abort it)


# Every flag that changes what the engine does at a step: ranks must agree on all.
_LOCKSTEP_FLAGS = (
    "session_slots", "max_parked_memory", "context_length", "chunk_size", "prefill_budget", "max_tokens",
    "max_batch", "no_warm_up", "no_prefix_reuse", "expert_cache_slots", "steering",
    "steering_mode", "steering_scale", "steering_layers", "kv_bits", "kv_group_size",
)  # fmt: skip


def join_group(args: argparse.Namespace) -> Lockstep:
    """The process group ``mlx.launch`` set up; refuse a lone process and ranks
    started with different engine flags (compared at start, one line)."""
    import hashlib
    import json

    import mlx.core as mx

    from turbospark.generation.distributed import Lockstep, launcher_backend
    from turbospark.layers.sharding import check_agree

    if not mx.distributed.is_available():
        raise InvalidInput("--distributed: this MLX build has no distributed backend")
    group = mx.distributed.init(backend=launcher_backend())
    if group.size() < 2:
        raise InvalidInput(
            "--distributed runs one rank of a group, but this process is alone: start it with "
            "`mlx.launch -n 2 --backend ring -- python -m turbospark serve ... --distributed`"
        )
    flags = json.dumps({name: getattr(args, name) for name in _LOCKSTEP_FLAGS}, sort_keys=True)
    check_agree(
        group,
        "serve flags",
        hashlib.sha256(flags.encode()).hexdigest(),
        f"start every rank with the same {', '.join('--' + f.replace('_', '-') for f in _LOCKSTEP_FLAGS)}",
    )
    return Lockstep(group, timeout=args.distributed_timeout)


def follow(
    args: argparse.Namespace,
    runner: Runner,
    codec: TextCodec,
    worker: RunnerWorker,
    lockstep: Lockstep,
    warm_up: list[int] | None,
) -> int:
    """A rank other than 0: no HTTP, the same engine stepped by rank 0's broadcasts
    until rank 0 stops."""
    import threading

    from turbospark.server.app import new_engine

    engine = new_engine(runner, codec, args.max_batch, args.prefill_budget, lockstep)

    def loop() -> None:
        if warm_up is not None:
            engine.warm_up(warm_up)
        engine.run(threading.Event())  # the stop comes from rank 0
        runner.close()

    print(f"rank {lockstep.rank} of {lockstep.group.size()}: following rank 0", flush=True)
    worker.run(loop)
    worker.shutdown()
    return 0
