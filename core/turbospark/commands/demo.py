"""``turbospark demo``: interleaved conversations through the session pool, and without it.

Builds (once, cached) a synthetic install, then serves the same workload of K
conversations × T turns, round-robin, with ``session_slots=K`` and with
``session_slots=1``, and prints per-turn reuse, prefill time, reason and
evictions, then the totals. Turns run through ``turbospark.generation.generate``, the
loop the server uses. Each conversation opens with the chat template's own
opening tokens, so the shallow-match rule is exercised too.

Each runner serves one untimed warm-up request first (loading the weights and
running MLX's first kernels), so both totals count the same work: prefill of
the workload's turns and nothing else.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy modules load in run(), so `turbospark --help` stays light
    from turbospark.generation.runner import Runner
    from turbospark.text import TextCodec

# Per-family sizes for the demo: large enough that prefill time is visible.
DEMO_DIMS: dict[str, dict[str, int]] = {
    "gemma4": {"vocab_size": 512, "num_layers": 4, "sliding_window": 64, "hidden_size": 256},
    "qwen_gdn": {"vocab_size": 512, "num_layers": 4, "hidden_size": 256},
}


@dataclass
class Turn:
    mode: str
    conversation: int
    turn: int
    prompt_tokens: int
    reused: int
    prefilled: int
    prefill_ms: float
    reason: str
    swapped: bool
    evicted: bool


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="run interleaved conversations on a synthetic install, with and without the pool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--family", default="gemma4", choices=sorted(DEMO_DIMS))
    parser.add_argument("--conversations", type=int, default=3, help="K conversations (pool size)")
    parser.add_argument("--turns", type=int, default=4, help="T turns per conversation")
    parser.add_argument("--turn-tokens", type=int, default=96, help="new user tokens per turn")
    parser.add_argument("--reply-tokens", type=int, default=8, help="greedy tokens per reply")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the demo's synthetic install is kept (default: turbospark's cache "
        "directory: $TURBOSPARK_CACHE, else $XDG_CACHE_HOME/turbospark, else ~/.cache/turbospark)",
    )
    parser.add_argument("--json", action="store_true", help="print per-turn records as JSON")
    parser.set_defaults(func=run)


def demo_install(family: str, cache_dir: Path) -> Path:
    """The cached synthetic install for *family* (built on first use)."""
    from turbospark.loading.install import MANIFEST, build_synthetic_install
    from turbospark.loading.synthetic import SYNTHETIC_FORMAT

    dims = DEMO_DIMS[family]
    tag = "-".join(f"{k}{v}" for k, v in sorted(dims.items()))
    path = cache_dir / "demo" / f"{family}-{tag}-v{SYNTHETIC_FORMAT}"
    if not (path / MANIFEST).is_file():
        print(f"building synthetic {family} install at {path} (once) ...", file=sys.stderr)
        build_synthetic_install(family, path, model_id=f"demo-{family}", dtype="float32", **dims)
    return path


def opening(codec: TextCodec) -> list[int]:
    """The tokens every chat prompt of this install starts with (Gemma's
    ``<bos><|turn>user\\n``, Qwen's ``<|im_start|>user\\n``): the template
    rendered up to where a user message's text goes."""
    marker = "\x00"
    rendered = codec.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=False
    )
    return codec.encode(rendered.split(marker)[0])


def warm_up(runner: Runner, codec: TextCodec, args: argparse.Namespace) -> None:
    """One untimed request of a turn's size, then the runner as it was: empty."""
    from turbospark.generation.generate import GenerationConfig, generate

    empty = runner.snapshot()
    prompt = opening(codec) + [32] * args.turn_tokens
    generate(runner, codec, prompt, GenerationConfig(max_tokens=args.reply_tokens))
    runner.restore(empty)


def run_workload(
    runner: Runner, codec: TextCodec, args: argparse.Namespace, mode: str
) -> list[Turn]:
    """K conversations × T turns, round-robin, through the server's generation loop."""
    from turbospark.generation.generate import GenerationConfig, generate

    rng = random.Random(0)
    histories = [opening(codec) for _ in range(args.conversations)]
    config = GenerationConfig(max_tokens=args.reply_tokens, stop_token_ids=[])
    turns: list[Turn] = []
    for turn in range(args.turns):
        for conv in range(args.conversations):
            new = [rng.randrange(32, runner.vocab_size) for _ in range(args.turn_tokens)]
            prompt = histories[conv] + new
            done = generate(runner, codec, prompt, config)
            stats = done.stats
            histories[conv] = prompt + done.tokens
            turns.append(
                Turn(mode, conv, turn, len(prompt), stats.reused_tokens,
                     len(prompt) - stats.reused_tokens, stats.prefill_seconds * 1e3,
                     stats.reuse_reason, stats.swapped, stats.evicted)
            )  # fmt: skip
    return turns


def run(args: argparse.Namespace) -> int:
    from turbospark.generation.runner import Runner
    from turbospark.paths import cache_root
    from turbospark.text import load_text

    path = demo_install(args.family, args.cache_dir or cache_root())
    codec = load_text(path)
    results: list[Turn] = []
    for mode, slots in (("pool", args.conversations), ("no-pool", 1)):
        runner = Runner.open(path, session_slots=slots)
        runner.set_prefix_reuse(True)
        warm_up(runner, codec, args)
        results += run_workload(runner, codec, args, mode)
    if args.json:
        print(json.dumps([asdict(t) for t in results], indent=2))
        return 0
    print(f"{args.family}: {args.conversations} conversations × {args.turns} turns, round-robin")
    print(
        f"{'mode':<8} {'conv':>4} {'turn':>4} {'prompt':>7} {'reused':>7} {'prefill':>8} {'ms':>8}  reason"
    )
    for t in results:
        flags = (" swapped" if t.swapped else "") + (" EVICTED" if t.evicted else "")
        print(
            f"{t.mode:<8} {t.conversation:>4} {t.turn:>4} {t.prompt_tokens:>7} {t.reused:>7} "
            f"{t.prefilled:>8} {t.prefill_ms:>8.1f}  {t.reason}{flags}"
        )
    print()
    for mode in ("pool", "no-pool"):
        rows = [t for t in results if t.mode == mode]
        print(
            f"{mode:<8} prefilled {sum(t.prefilled for t in rows):>6} tokens, "
            f"reused {sum(t.reused for t in rows):>6}, prefill {sum(t.prefill_ms for t in rows):>8.1f} ms, "
            f"evictions {sum(t.evicted for t in rows)}"
        )
    pool, plain = ([t.prefill_ms for t in results if t.mode == m] for m in ("pool", "no-pool"))
    print(
        f"same turns, both runners warmed up: the pool prefilled in "
        f"{sum(pool) / sum(plain):.2f}x the time without it"
    )
    return 0
