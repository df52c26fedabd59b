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
(``GenerationStats.decode_tokens_per_second``). Each point is *reps* pairs of
an ``off`` run and a drafted run back to back; its speedup is the median of
the pairs' ratios (a shared, loaded machine drifts less within a pair).

    uv run python bench/draft.py INSTALL [--depths 1 2 4] [--tokens 48] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
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

    def paired(
        ids: list[int], make: Callable[[int], Drafter], expected: list[int] | None = None
    ) -> dict[str, Any]:
        """*reps* pairs of (off, drafted) runs back to back: the speedup is the
        median of the pairs' ratios, so load that drifts between pairs cancels."""
        ratios, off, on = [], [], []
        for rep in range(reps):
            plain = generate(runner, codec, ids, config).stats.decode_tokens_per_second
            done = generate(runner, codec, ids, config, drafter=make(rep))
            off.append(plain)
            on.append(done.stats.decode_tokens_per_second)
            ratios.append(on[-1] / plain)
        return {
            "tok_s": statistics.median(on),
            "off_tok_s": statistics.median(off),
            "speedup_vs_off": statistics.median(ratios),
            "speedup_spread": max(ratios) - min(ratios),
            "proposed": done.stats.draft_proposed,
            "accepted": done.stats.draft_accepted,
            "acceptance": done.stats.draft_accepted / max(1, done.stats.draft_proposed),
            "output_equals_off": None if expected is None else done.tokens == expected,
        }

    reference = [*prompt, *generate(runner, codec, prompt, config).tokens]  # also the warm-up
    curve = []
    for depth in depths:
        generate(runner, codec, prompt, config, drafter=ReplayDrafter(reference, vocab, depth))
        for accuracy in accuracies:
            point = paired(
                prompt,
                lambda rep, d=depth, a=accuracy: ReplayDrafter(reference, vocab, d, a, seed=rep),
                reference[len(prompt) :],
            )
            curve.append({"depth": depth, "accuracy": accuracy, **point})

    text = random_tokens(TEXT_TOKENS, vocab, seed=12)
    edited = [*text[: TEXT_TOKENS // 3], *random_tokens(4, vocab, seed=13)]
    copy_prompt = [*text, *edited]  # the text, then an edited copy that is being written
    # min_match 1: random weights never copy, so longer matches would propose nothing;
    # this measures what lookups and rejected drafts cost on a copy-heavy context.
    ngram = paired(copy_prompt, lambda rep: NgramDrafter(max(depths), 1))
    return {"curve": curve, "ngram_copy": ngram, "tokens": tokens, "reps": reps}


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
    print(f"draft ({family}): speedup against off by depth x accuracy (median of paired runs)")
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
