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
import sys

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TurbosparkError as exc:
        print(f"turbospark: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
