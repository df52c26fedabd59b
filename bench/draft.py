"""Speculative decoding: decode tok/s against acceptance rate and depth, against ``off``.

Random weights make a real drafter's acceptance meaningless, so the curve is
drawn with oracles (:class:`turbospark.draft.ReplayDrafter`): each replays the
greedy reply recorded without drafts, every token right with probability p
(1: all accepted, 0: hopeless, where the adaptive depth must keep the cost
within 5% of ``off``). Depth is the drafter's most tokens per round. Also
``ngram`` (prompt lookup) on a copy-heavy prompt: a long text, then the start
of an edited copy of it.

Every run is greedy with ``ignore_eos`` (``stop_token_ids=[]``) and the same
number of generated tokens; tok/s is the generation loop's own decode rate
(``GenerationStats.decode_tokens_per_second``), median over the reps.

    uv run python bench/draft.py INSTALL [--depths 1 2 4] [--tokens 48] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import random_tokens
from turbospark.draft import Drafter, NgramDrafter, ReplayDrafter
from turbospark.generate import GenerationConfig, generate
from turbospark.runner import Runner
from turbospark.text import load_text

ACCURACIES = (1.0, 0.75, 0.5, 0.25, 0.0)
PROMPT_TOKENS = 128
TEXT_TOKENS = 384  # the copy-heavy prompt's long text


def bench_draft(
    path: Path,
    depths: Sequence[int],
    accuracies: Sequence[float] = ACCURACIES,
    tokens: int = 48,
    reps: int = 3,
) -> dict[str, Any]:
    runner = Runner.open(path, context_length=TEXT_TOKENS * 2 + tokens + 8)
    codec = load_text(path)
    vocab = runner.vocab_size
    config = GenerationConfig(max_tokens=tokens, stop_token_ids=[])
    prompt = random_tokens(PROMPT_TOKENS, vocab, seed=11)

    def run(ids: list[int], drafter: Drafter | None) -> dict[str, Any]:
        rows = [generate(runner, codec, ids, config, drafter=drafter) for _ in range(reps)]
        stats = [r.stats for r in rows]
        return {
            "tok_s": statistics.median(s.decode_tokens_per_second for s in stats),
            "tok_s_spread": max(s.decode_tokens_per_second for s in stats)
            - min(s.decode_tokens_per_second for s in stats),
            "proposed": stats[-1].draft_proposed,
            "accepted": stats[-1].draft_accepted,
            "tokens": rows[-1].tokens,
        }

    generate(runner, codec, prompt, config)  # warm-up: kernels built, allocator primed
    off = run(prompt, None)
    reference = [*prompt, *off.pop("tokens")]
    curve = []
    for depth in depths:
        generate(runner, codec, prompt, config, drafter=ReplayDrafter(reference, vocab, depth))
        for accuracy in accuracies:
            drafter = ReplayDrafter(reference, vocab, depth, accuracy, seed=depth)
            point = run(prompt, drafter)
            same = point.pop("tokens") == reference[len(prompt) :]
            curve.append(
                {
                    "depth": depth,
                    "accuracy": accuracy,
                    **point,
                    "acceptance": point["accepted"] / max(1, point["proposed"]),
                    "speedup_vs_off": point["tok_s"] / off["tok_s"],
                    "output_equals_off": same,
                }
            )

    text = random_tokens(TEXT_TOKENS, vocab, seed=12)
    edited = [*text[: TEXT_TOKENS // 3], *random_tokens(4, vocab, seed=13)]
    copy_prompt = [*text, *edited]  # the text, then an edited copy that is being written
    copy_off = run(copy_prompt, None)
    copy_off.pop("tokens")
    ngram = run(copy_prompt, NgramDrafter(max(depths), 2))
    ngram.pop("tokens")
    ngram["speedup_vs_off"] = ngram["tok_s"] / copy_off["tok_s"]
    return {
        "off_tok_s": off["tok_s"],
        "off_tok_s_spread": off["tok_s_spread"],
        "curve": curve,
        "ngram_copy": {"off_tok_s": copy_off["tok_s"], **ngram},
        "tokens": tokens,
        "reps": reps,
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The two targets: 100% at depth 4 (or the deepest run) and 0% at any depth."""
    curve = result["curve"]
    perfect = [p for p in curve if p["accuracy"] == 1.0]
    at4 = next((p for p in perfect if p["depth"] == 4), perfect[-1] if perfect else None)
    hopeless = [p["speedup_vs_off"] for p in curve if p["accuracy"] == 0.0]
    return {
        "draft_full_acceptance_depth": None if at4 is None else at4["depth"],
        "draft_full_acceptance_speedup": None if at4 is None else at4["speedup_vs_off"],
        "draft_zero_acceptance_worst_speedup": min(hopeless) if hopeless else None,
    }


def print_curve(family: str, result: dict[str, Any]) -> None:
    print(f"draft ({family}): off {result['off_tok_s']:.1f} tok/s; speedup by depth x accuracy")
    accuracies = sorted({p["accuracy"] for p in result["curve"]}, reverse=True)
    print("  depth " + "".join(f"{a:>8.0%}" for a in accuracies))
    for depth in sorted({p["depth"] for p in result["curve"]}):
        row = {p["accuracy"]: p["speedup_vs_off"] for p in result["curve"] if p["depth"] == depth}
        print(f"  {depth:>5} " + "".join(f"{row[a]:>8.2f}" for a in accuracies))
    n = result["ngram_copy"]
    print(
        f"  ngram on a copy-heavy prompt: {n['tok_s']:.1f} tok/s vs off {n['off_tok_s']:.1f} "
        f"({n['speedup_vs_off']:.2f}x), accepted {n['accepted']}/{n['proposed']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("install", type=Path)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--accuracies", type=float, nargs="+", default=list(ACCURACIES))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    result = bench_draft(args.install, args.depths, args.accuracies, args.tokens, args.reps)
    print(json.dumps(result, indent=2))
    print_curve(args.install.name, result)


if __name__ == "__main__":
    main()
