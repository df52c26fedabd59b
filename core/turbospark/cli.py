"""The ``turbospark`` command: one subcommand per module in :mod:`turbospark.commands`.

Each command module exposes ``register(subparsers)``, which adds its parser and
sets ``func`` (taking the parsed namespace, returning an exit code). Building
the parser imports every command module, so each keeps MLX, the web server
and the conformance kit out of its top level and imports them in ``func``:
``turbospark --help`` then loads none of them (``tests/test_cli.py`` checks).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import NoReturn

from turbospark.errors import TurbosparkError

COMMANDS = [
    "demo",
    "families",
    "generate",
    "chat",
    "serve",
    "import_",
    "conformance",
    "steer",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turbospark",
        description="Run LLM families on MLX and keep many conversations warm on one model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"turbospark.commands.{name}").register(sub)
    return parser


def keep_compiled_kernels() -> None:
    """Point MLX's cache of compiled GPU kernels under turbospark's cache
    directory (``kernels/mlx-<version>``) unless ``MLX_PTX_CACHE_DIR`` names
    one. MLX compiles each CUDA kernel on first use (seconds each) and keeps
    the result in the system's temporary directory by default, which a
    reboot or a fresh container empties: a restarted server would compile
    every kernel again before its first token. Read once, at MLX's first
    compile, so it is set before any command runs."""
    if os.environ.get("MLX_PTX_CACHE_DIR"):
        return
    from importlib.metadata import PackageNotFoundError, version

    from turbospark.paths import cache_root

    try:
        mlx = version("mlx")
    except PackageNotFoundError:
        return
    os.environ["MLX_PTX_CACHE_DIR"] = str(cache_root() / "kernels" / f"mlx-{mlx}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_compiled_kernels()
    try:
        return int(args.func(args) or 0)
    except TurbosparkError as exc:
        print(f"turbospark: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> NoReturn:
    """The console entry point: :func:`main`, then leave at once with its code.

    MLX's per-thread destructors take the GIL. A thread that ran MLX (the
    server's runner thread) and ended just before the interpreter finalizes
    can run them during finalization, which aborts the process ("terminate
    called without an active exception", exit 134) instead of returning the
    command's code. Every output is flushed and every log handler closed
    first; nothing else is left to finalize once a command has returned."""
    try:
        code = main()
    except SystemExit as exc:  # argparse: --help, or a usage error it already printed
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
