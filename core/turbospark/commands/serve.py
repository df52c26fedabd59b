"""``turbospark serve MODEL``: the OpenAI-compatible server on one install."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from turbospark.commands import add_pool_memory_flag, install_text
from turbospark.errors import InvalidInput

if TYPE_CHECKING:  # the heavy modules load in run(), so `turbospark --help` stays light
    from turbospark.runner import Runner


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve an install over the OpenAI API (chat/completions, completions, models)",
        description="Serve MODEL (an install directory) on an OpenAI-compatible HTTP API. "
        "Conversations are matched to sessions by token content: with --session-slots N, "
        "up to N conversations stay warm at once.",
    )
    parser.add_argument("model", type=Path, metavar="MODEL", help="an install directory")
    parser.add_argument("--session-slots", type=int, default=1, help="conversations kept warm")
    add_pool_memory_flag(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=512, help="prefill tokens per forward")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="default max_tokens when a request omits it"
    )
    parser.add_argument(
        "--no-prefix-reuse", action="store_true", help="prefill every prompt from scratch"
    )
    parser.add_argument("--model-id", help="the served model name (default: the manifest's)")
    parser.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> None:
    """Refuse contradictory flags before anything is loaded."""
    if args.no_prefix_reuse and args.session_slots > 1:
        raise InvalidInput(
            f"--session-slots {args.session_slots} with --no-prefix-reuse would keep "
            f"{args.session_slots - 1} parked session(s) that nothing can ever resume: sessions "
            "are found by prefix reuse; drop --no-prefix-reuse or use --session-slots 1"
        )
    if args.chunk_size <= 0:
        raise InvalidInput(f"--chunk-size must be positive, got {args.chunk_size}")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from turbospark.runner import Runner
    from turbospark.server.app import create_app
    from turbospark.server.worker import RunnerWorker

    check_args(args)
    codec = install_text(args.model)
    worker = RunnerWorker()

    def open_runner() -> Runner:
        runner = Runner.open(
            args.model,
            context_length=args.context_length,
            session_slots=args.session_slots,
            max_parked_bytes=args.max_parked_memory,
        )
        runner.set_prefix_reuse(not args.no_prefix_reuse)
        return runner

    runner = worker.run(open_runner)  # MLX work stays on the worker thread
    app = create_app(
        runner,
        codec,
        model_id=args.model_id,
        chunk_size=args.chunk_size,
        default_max_tokens=args.max_tokens,
        worker=worker,
    )
    print(
        f"serving {args.model_id or runner.manifest.model_id} ({runner.manifest.family}) on "
        f"http://{args.host}:{args.port}/v1 with {runner.session_pool_size} session slot(s)",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
