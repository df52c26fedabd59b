"""``turbospark generate MODEL --prompt TEXT``: one completion, streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from turbospark.commands import (
    MODEL_HELP,
    add_draft_flags,
    add_expert_cache_flag,
    add_kv_cache_flags,
    draft_policy,
    kv_cache_options,
    model_text,
    prompt_ids,
)
from turbospark.commands.steer import add_steering_args, steering_policy

if TYPE_CHECKING:  # the heavy modules load in run(), so `turbospark --help` stays light
    from turbospark.generation.generate import GenerationConfig


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """The sampling flags ``generate`` and ``chat`` share."""
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--context-length", type=int, default=4096)


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    from turbospark.generation.generate import GenerationConfig

    return GenerationConfig(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
    )


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "generate",
        help="generate one completion from a model",
        description="Generate from MODEL (an install, a checkpoint directory or a hub id). "
        "The prompt is sent as one user message through the model's chat template unless "
        "--raw is given.",
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--raw", action="store_true", help="skip the chat template")
    add_sampling_args(parser, max_tokens=128)
    add_draft_flags(parser)
    add_expert_cache_flag(parser)
    add_kv_cache_flags(parser)
    add_steering_args(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from turbospark.generation.generate import collect, stream_generate
    from turbospark.generation.runner import Runner
    from turbospark.policies import ExpertCacheSlots

    source, codec = model_text(args.model)
    config = generation_config(args)  # refuse bad flags before loading weights
    steering = steering_policy(args)
    runner = Runner.open(
        source,
        context_length=args.context_length,
        draft=draft_policy(args),
        expert_cache=ExpertCacheSlots.parse(args.expert_cache_slots),
        steering=steering,
        **kv_cache_options(args),
    )
    ids = prompt_ids(codec, args.prompt, args.raw)
    show = None if args.json else print_text
    done = collect(stream_generate(runner, codec, ids, config), on_text=show)
    if args.json:
        record = {
            "text": done.text,
            "tokens": done.tokens,
            "finish_reason": done.finish_reason,
            "stats": done.stats.summary(),
        }
        print(json.dumps(record))
    else:
        print()
        print(done.stats.describe(), file=sys.stderr)
    return 0


def print_text(text: str) -> None:
    """Stream text to stdout as it arrives."""
    print(text, end="", flush=True)
