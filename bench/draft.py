"""Speculative decoding: decode tok/s against acceptance rate and depth, against ``off``.

Random weights make a real drafter's acceptance meaningless, so the curve is
drawn with oracles (:class:`turbospark.generation.drafters.ReplayDrafter`): each replays a
recorded greedy reply, every token right with probability p (1: all accepted,
0: hopeless, where the adaptive depth must keep the cost within 5% of ``off``).

The reply replayed is recorded from the drafted path itself, per depth
(:func:`fixed_point_reference`): in bf16 a verify pass (``k + 1`` tokens in
one forward) rounds differently from a one-token step, random weights'
near-tied logits flip, and a drafted run then leaves the reply recorded
without drafts, after which every replayed draft is wrong. Replaying the
drafted run's own output until it reproduces itself gives a reply the 100%
oracle really gets all of (``acceptance`` 1.0; where it does not settle,
``reference_settled`` is false and ``acceptance`` says how near 1 it came); ``output_equals_off`` still
says whether that reply is ``off``'s (it is in float32). Depth is the drafter's most tokens per round. Also
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
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import random_tokens
from turbospark.generation.drafters import Drafter, NgramDrafter, ReplayDrafter
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.mtp import MtpDrafter
from turbospark.generation.runner import Runner
from turbospark.generation.sampling import Sampler, SamplingParams
from turbospark.policies import DraftPolicies
from turbospark.text import TextCodec, load_text

ACCURACIES = (1.0, 0.75, 0.5, 0.25, 0.0)
MTP_FAMILIES = ("qwen_gdn",)  # families whose synthetic installs can carry an MTP head
FIXED_POINT_ROUNDS = 32  # recordings fixed_point_reference tries before it gives up
PROPOSALS = 20  # timed MTP proposals per depth
PROMPT_TOKENS = 128
TEXT_TOKENS = 384  # the copy-heavy prompt's long text


def bench_draft(
    path: Path,
    depths: Sequence[int],
    accuracies: Sequence[float] = ACCURACIES,
    tokens: int = 48,
    reps: int = 3,
    mtp_install: Path | None = None,
) -> dict[str, Any]:
    """The oracle curve and prompt lookup; with *mtp_install* (the same shapes
    with an MTP head) also the ``mtp`` rows (:func:`bench_mtp`)."""
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
            "probed": done.stats.draft_probed,
            "output_equals_off": None if expected is None else done.tokens == expected,
        }

    off_reply = generate(runner, codec, prompt, config).tokens  # also the warm-up
    curve = []
    for depth in depths:
        reference, rounds, settled = fixed_point_reference(runner, codec, prompt, config, depth)
        for accuracy in accuracies:
            point = paired(
                prompt,
                lambda rep, d=depth, a=accuracy, r=reference: ReplayDrafter(r, vocab, d, a, rep),
                off_reply,
            )
            point["reference_rounds"] = rounds
            point["reference_settled"] = settled
            point["reference_equals_off"] = reference[len(prompt) :] == off_reply
            curve.append({"depth": depth, "accuracy": accuracy, **point})

    text = random_tokens(TEXT_TOKENS, vocab, seed=12)
    edited = [*text[: TEXT_TOKENS // 3], *random_tokens(4, vocab, seed=13)]
    copy_prompt = [*text, *edited]  # the text, then an edited copy that is being written
    # min_match 1: random weights never copy, so longer matches would propose nothing;
    # this measures what lookups and rejected drafts cost on a copy-heavy context.
    ngram = paired(copy_prompt, lambda rep: NgramDrafter(max(depths), 1))
    result = {"curve": curve, "ngram_copy": ngram, "tokens": tokens, "reps": reps}
    if mtp_install is not None:
        result["mtp"] = bench_mtp(mtp_install, depths, tokens, reps)
    return result


def fixed_point_reference(
    runner: Runner,
    codec: TextCodec,
    prompt: list[int],
    config: GenerationConfig,
    depth: int,
    limit: int = FIXED_POINT_ROUNDS,
) -> tuple[list[int], int, bool]:
    """``(prompt + reply, recordings, settled)``: a greedy reply that the
    drafted path at *depth*, replaying it, reproduces token for token, so its
    100% oracle accepts every draft. Starts from ``off``'s reply and replays
    the drafted run's own output until it stops changing (each pass agrees
    with the last one for longer: the drafted path is deterministic, and it
    only leaves the replayed reply where a draft was wrong). Each recording
    settles the reply only up to its next near-tie that a verify pass rounds
    unlike a step, so where those are dense (gemma4 in bf16 on the H200)
    *limit* recordings may not reach the end: then the last recording is
    returned with *settled* False, and its oracle's measured acceptance (just
    under 1) is what a row reports."""
    reply = generate(runner, codec, prompt, config).tokens
    for recording in range(1, limit + 1):
        drafter = ReplayDrafter([*prompt, *reply], runner.vocab_size, depth)
        again = generate(runner, codec, prompt, config, drafter=drafter).tokens
        if again == reply:
            return [*prompt, *reply], recording, True
        reply = again
    return [*prompt, *reply], limit, False


def bench_mtp(path: Path, depths: Sequence[int], tokens: int, reps: int) -> list[dict[str, Any]]:
    """Per depth: paired runs of ``off`` and ``DraftPolicies.mtp(depth)`` on one
    install (tok/s, speedup, acceptance), and the synced time of one MTP
    proposal after the prompt (the drafter rewinds its own steps, so every
    proposal does the same work) against one plain decode step."""
    context = PROMPT_TOKENS + tokens + max(depths) + 8
    off_runner = Runner.open(path, context_length=context)
    codec = load_text(path)
    config = GenerationConfig(max_tokens=tokens, stop_token_ids=[])
    prompt = random_tokens(PROMPT_TOKENS, off_runner.vocab_size, seed=11)
    expected = generate(off_runner, codec, prompt, config).tokens  # also the warm-up
    rows = []
    for depth in depths:
        runner = Runner.open(path, context_length=context, draft=DraftPolicies.mtp(depth))
        generate(runner, codec, prompt, config)  # warm-up: compiled steps, buffers
        ratios, off, on = [], [], []
        for _ in range(reps):
            plain = generate(off_runner, codec, prompt, config).stats.decode_tokens_per_second
            done = generate(runner, codec, prompt, config)
            off.append(plain)
            on.append(done.stats.decode_tokens_per_second)
            ratios.append(on[-1] / plain)
        drafter = MtpDrafter(
            runner.mtp_head, lambda r=runner: r.mtp_track(None), Sampler(SamplingParams()), depth
        )
        runner.reset()
        runner.prefill_chunk(prompt, 0)
        following = [*prompt, expected[0]]
        drafter.propose(following, depth)  # catches up on the prompt once (not timed)
        proposals, steps = [], []
        for _ in range(PROPOSALS):  # interleaved, so load hits both alike
            started = time.perf_counter()
            drafter.propose(following, depth)  # redoes the last entry, then depth - 1 steps
            proposals.append(time.perf_counter() - started)
            started = time.perf_counter()
            mx.eval(runner.produce(mx.array(expected[0]), len(prompt)))  # one plain step
            steps.append(time.perf_counter() - started)
            runner.take_back()
        proposal_ms = statistics.median(proposals) * 1e3
        step_ms = statistics.median(steps) * 1e3
        off_tok_s = statistics.median(off)
        rows.append(
            {
                "depth": depth,
                "tok_s": statistics.median(on),
                "off_tok_s": off_tok_s,
                "speedup_vs_off": statistics.median(ratios),
                "speedup_spread": max(ratios) - min(ratios),
                "proposed": done.stats.draft_proposed,
                "accepted": done.stats.draft_accepted,
                "acceptance": done.stats.draft_accepted / max(1, done.stats.draft_proposed),
                "probed": done.stats.draft_probed,
                "output_equals_off": done.tokens == expected,
                "proposal_ms": proposal_ms,
                "decode_step_ms": step_ms,
                "proposal_vs_decode_step": proposal_ms / step_ms,
            }
        )
    return rows


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
    for m in result.get("mtp", []):
        print(
            f"  mtp depth {m['depth']}: {m['tok_s']:.1f} tok/s vs off {m['off_tok_s']:.1f} "
            f"({m['speedup_vs_off']:.2f}x) at acceptance {m['accepted']}/{m['proposed']} "
            f"({m['probed']} probed); "
            f"one proposal {m['proposal_ms']:.2f} ms = {m['proposal_vs_decode_step']:.2f} "
            f"plain decode steps ({m['decode_step_ms']:.2f} ms)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("install", type=Path)
    parser.add_argument("--mtp-install", type=Path, help="the same shapes with an MTP head")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--accuracies", type=float, nargs="+", default=list(ACCURACIES))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    result = bench_draft(
        args.install, args.depths, args.accuracies, args.tokens, args.reps, args.mtp_install
    )
    print(json.dumps(result, indent=2))
    print_curve(args.install.name, result)


if __name__ == "__main__":
    main()
