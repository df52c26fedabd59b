"""``turbospark chat MODEL``: a REPL that shows what prefix reuse did on every turn.

Each line you type is a user turn; the reply streams back and a status line
(on stderr) says how many prompt tokens were reused and why. ``/switch NAME``
moves to another conversation (created on first use), so with
``--session-slots N`` you can watch parked sessions being resumed; ``/quit``
or end of input leaves. Works with piped stdin (one turn per line).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from turbospark.commands import (
    MODEL_HELP,
    add_draft_flags,
    add_expert_cache_flag,
    add_kv_cache_flags,
    add_pool_memory_flag,
    draft_policy,
    kv_cache_options,
    model_text,
)
from turbospark.commands.generate import add_sampling_args, generation_config, print_text
from turbospark.commands.steer import add_steering_args, steering_policy
from turbospark.errors import TurbosparkError

if TYPE_CHECKING:  # the heavy modules load in run(), so `turbospark --help` stays light
    from turbospark.generation.generate import Completion, GenerationConfig
    from turbospark.generation.runner import Runner
    from turbospark.text import TextCodec


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "chat",
        help="chat with a model, showing prefix reuse per turn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--session-slots", type=int, default=1, help="conversations kept warm")
    add_pool_memory_flag(parser)
    add_expert_cache_flag(parser)
    parser.add_argument("--system", help="a system message opening every conversation")
    add_sampling_args(parser, max_tokens=256)
    add_draft_flags(parser)
    add_kv_cache_flags(parser)
    add_steering_args(parser)
    parser.set_defaults(func=run)


def read_line(interactive: bool, name: str) -> str | None:
    """The next user line, or None at end of input."""
    if interactive:
        try:
            return input(f"{name}> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def turn(
    runner: Runner, codec: TextCodec, messages: list[dict[str, str]], config: GenerationConfig
) -> Completion:
    """Stream one reply to stdout; a bad prompt is refused before any output."""
    from turbospark.generation.generate import check_prompt, collect, stream_generate

    ids = codec.encode_chat(messages)
    check_prompt(runner, ids)
    reply = collect(stream_generate(runner, codec, ids, config), on_text=print_text)
    print(flush=True)
    return reply


def run(args: argparse.Namespace) -> int:
    from turbospark.generation.runner import Runner
    from turbospark.policies import ExpertCacheSlots

    source, codec = model_text(args.model)
    config = generation_config(args)
    runner = Runner.open(
        source,
        context_length=args.context_length,
        expert_cache=ExpertCacheSlots.parse(args.expert_cache_slots),
        session_slots=args.session_slots,
        max_parked_bytes=args.max_parked_memory,
        draft=draft_policy(args),
        steering=steering_policy(args),
        **kv_cache_options(args),
    )
    runner.set_prefix_reuse(True)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    conversations: dict[str, list[dict[str, str]]] = {"main": list(opening)}
    current = "main"
    interactive = sys.stdin.isatty()
    while (line := read_line(interactive, current)) is not None:
        text = line.strip()
        if not text:
            continue
        if text == "/quit":
            break
        if text.startswith("/switch"):
            current = text.removeprefix("/switch").strip() or "main"
            conversations.setdefault(current, list(opening))
            print(f"[conversation {current!r}]", file=sys.stderr)
            continue
        messages = conversations[current]
        try:
            reply = turn(runner, codec, [*messages, {"role": "user", "content": text}], config)
        except TurbosparkError as exc:  # e.g. the conversation outgrew the context
            print(f"[{current}] refused: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"[{current}] {reply.stats.describe()}", file=sys.stderr, flush=True)
        messages += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": reply.text},
        ]
    return 0
