"""Where a drafted round's host time goes, against a plain decode step.

A *tiny* synthetic install makes decode host-bound on a CPU, as a ~1B model's
decode is on an H200 (graph building and kernel encoding, not arithmetic), so
the host cost of a round shows. Host time is the calling thread's CPU time
(``time.thread_time``): MLX evaluates on its own threads, so this counts the
Python and graph building the loop does and not the compute or the waits, and
it barely moves with the load other processes put on the machine. Wall time
(``time.perf_counter``) is reported beside it: the waits are the difference.

Each run is one greedy request (``ignore_eos``) decoding *tokens* tokens; the
numbers are per generated token, from the first token yielded to the last
(prefill and the first step left out). Drafted runs use the oracle
(:class:`turbospark.generation.drafters.ReplayDrafter`) at 100% on a reference recorded
from the drafted path itself (see ``bench/draft.py``), and at 0%. The phase
split wraps the methods a round calls (the drafter's proposal, the verify
forward's build and queueing, the read of the target's choices, the cut back
or commit), the shadow probes' (:meth:`Speculation.probe` and
:meth:`Speculation.observe`: the guess and its comparison, the lookup inside
counted under ``propose``), and the rest of the loop (detokenising,
emitting), and takes the calling thread's own time in each (a call inside
another phase's is taken out of that one's).

``kernels``: a plain step's graph and a verify pass's of ``depth + 1``
tokens (a shadow probe adds none to its step: its guess is a host lookup).
``lookup_us``: the host time of one depth-1 lookup a probe makes, prompt
lookup (:class:`turbospark.generation.drafters.NgramDrafter`) over a context as long as
the run's and the oracle's, to set against a step's host time.

    uv run python bench/draft_round.py [--family qwen_gdn] [--depth 4] [--tokens 96] [--reps 5]
        [--size tiny] [--dtype float32]

On the H200: ``python3 bench/gpu.py OUT --family qwen_gdn --only draft_round``
(*large* bf16, depth 4, 128 tokens, oracles at 100% and 0%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from bench.common import DEFAULT_CACHE, install, random_tokens
from bench.decode_cost import graph_primitives
from bench.draft import fixed_point_reference
from turbospark.generation import runner as runner_module
from turbospark.generation import speculation as speculative
from turbospark.generation.drafters import NgramDrafter, ReplayDrafter
from turbospark.generation.generate import GenerationConfig, stream_generate
from turbospark.generation.runner import Runner
from turbospark.text import load_text

PROMPT_TOKENS = 16
# The methods a round calls, by phase: (owner, attribute).
PHASES: dict[str, list[tuple[Any, str]]] = {
    "propose": [(ReplayDrafter, "propose")],
    "verify_build": [(runner_module.Runner, "verify")],
    "read_accept": [(speculative, "accept_greedy"), (speculative.Speculation, "resolve")],
    "rollback_commit": [(speculative.Speculation, "commit"), (speculative.Speculation, "cut")],
    "probe": [(speculative.Speculation, "probe"), (speculative.Speculation, "observe")],
}


@contextmanager
def phase_timers(host: dict[str, float]) -> Iterator[None]:
    """Wrap every method in :data:`PHASES` so its thread time adds to *host*; a
    timed call inside another counts in its own phase only."""
    saved = []
    inner = [0.0]  # per open timed call: the time its timed callees took

    for phase, targets in PHASES.items():
        for owner, name in targets:
            original = getattr(owner, name, None)
            if original is None:
                continue

            def timed(*args: Any, _f: Callable = original, _p: str = phase, **kw: Any) -> Any:
                started = time.thread_time()
                inner.append(0.0)
                try:
                    return _f(*args, **kw)
                finally:
                    took = time.thread_time() - started
                    host[_p] += took - inner.pop()
                    inner[-1] += took

            saved.append((owner, name, original))
            setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def timed_run(
    runner: Runner, codec: Any, prompt: list[int], config: GenerationConfig, drafter: Any
) -> dict[str, float]:
    """Host and wall seconds per token after the first, with the phase split."""
    host: dict[str, float] = defaultdict(float)
    tokens = 0
    with phase_timers(host):
        chunks = stream_generate(runner, codec, prompt, config, drafter=drafter)
        next(chunks)  # prefill and the first token: not counted
        for phase in list(host):
            host[phase] = 0.0
        thread0, wall0 = time.thread_time(), time.perf_counter()
        for chunk in chunks:
            tokens += chunk.token is not None
        thread, wall = time.thread_time() - thread0, time.perf_counter() - wall0
        stats = chunk.stats
    split = {phase: seconds / tokens * 1e6 for phase, seconds in host.items()}
    split["rest_of_loop"] = thread / tokens * 1e6 - sum(split.values())
    return {
        "host_us_per_token": thread / tokens * 1e6,
        "wall_us_per_token": wall / tokens * 1e6,
        "host_us_by_phase": split,
        "accepted": stats.draft_accepted,
        "proposed": stats.draft_proposed,
        "probed": stats.draft_probed,
    }


def kernels(runner: Runner, prompt: list[int], depth: int) -> dict[str, int]:
    """Kernels in one plain step's graph and in one verify pass of ``depth + 1``
    tokens, the state writes included; exact, load-independent."""
    counts = {}
    for name, fed in (("step", 1), ("verify", depth + 1)):
        runner.reset()
        runner.prefill_chunk(prompt, 0, logits=False)
        live = runner.sessions()[0]
        mx.eval([a for c in live.state.values() for a in c.arrays()])
        if fed > 1:
            for component in runner.traced_components:
                live.state[component].trace()  # as Runner.verify does
        logits = runner._hook.turbospark_forward(
            model=runner.model, tokens=mx.array(prompt[:fed], mx.int32), start=len(prompt),
            state=live.state, vision=None, logits="all" if fed > 1 else "last", steer=None,
        )  # fmt: skip
        arrays = [logits, *(a for c in live.state.values() for a in c.arrays())]
        counts[name] = graph_primitives(arrays)["kernels"]
    runner.reset()
    return counts


def lookup_us(context_tokens: int, vocab: int, calls: int = 2000) -> dict[str, float]:
    """Host µs of one depth-1 lookup as a shadow probe makes it, on a context of
    *context_tokens* random ids (growing by one per call, as a reply's does):
    prompt lookup (its index kept up to date, as a request's is) and the oracle."""
    ids = random_tokens(context_tokens + calls, vocab, seed=5)
    out = {}
    for name, drafter in (
        ("ngram", NgramDrafter(max_draft=4, min_match=1)),
        ("replay", ReplayDrafter(ids, vocab, 4, accuracy=0.0)),
    ):
        drafter.propose(ids[:context_tokens], 1)  # index the prompt, as prefill's first round
        started = time.thread_time()
        for end in range(context_tokens + 1, context_tokens + calls + 1):
            drafter.propose(ids[:end], 1)
        out[name] = (time.thread_time() - started) / calls * 1e6
    # Of which: the context copy (prompt + reply) a probe makes, as Speculation.observe does.
    started = time.thread_time()
    for end in range(context_tokens + 1, context_tokens + calls + 1):
        [*ids[:end]]
    out["of_which_context_copy"] = (time.thread_time() - started) / calls * 1e6
    return out


def profile(
    family: str,
    depth: int,
    tokens: int,
    reps: int,
    accuracies: tuple[float, ...] = (1.0, 0.0),
    cache: Path = DEFAULT_CACHE,
    size: str = "tiny",
    dtype: str = "float32",
) -> dict[str, Any]:
    """The split for one family. *size*/*dtype*: *tiny* float32 is the CPU's
    host-bound proxy; on a GPU (``gpu.py --only draft_round``) *large* bf16,
    where the split says what a round costs beyond its verify forward."""
    path = install(family, size, dtype, cache)
    runner = Runner.open(path, context_length=PROMPT_TOKENS + tokens + 16)
    codec = load_text(path)
    config = GenerationConfig(max_tokens=tokens, stop_token_ids=[])
    prompt = random_tokens(PROMPT_TOKENS, runner.vocab_size, seed=11)
    reference, _, settled = fixed_point_reference(runner, codec, prompt, config, depth)
    rows: dict[str, list[dict[str, Any]]] = {"off": []}
    for rep in range(reps + 1):  # the first round warms up (compiled steps, buffers)
        rows["off"].append(timed_run(runner, codec, prompt, config, None))
        for accuracy in accuracies:
            drafter = ReplayDrafter(reference, runner.vocab_size, depth, accuracy, seed=rep)
            run = timed_run(runner, codec, prompt, config, drafter)
            rows.setdefault(f"drafted_{accuracy:.0%}", []).append(run)
    out: dict[str, Any] = {
        "family": family,
        "size": size,
        "dtype": dtype,
        "depth": depth,
        "tokens": tokens,
        "reps": reps,
        "reference_settled": settled,
    }
    out["kernels"] = kernels(runner, prompt, depth)
    out["lookup_us"] = lookup_us(PROMPT_TOKENS + tokens, runner.vocab_size)
    for name, runs in rows.items():
        runs = runs[1:]
        phases = {p for r in runs for p in r["host_us_by_phase"]}
        out[name] = {
            "host_us_per_token": statistics.median(r["host_us_per_token"] for r in runs),
            "host_us_spread": max(r["host_us_per_token"] for r in runs)
            - min(r["host_us_per_token"] for r in runs),
            "wall_us_per_token": statistics.median(r["wall_us_per_token"] for r in runs),
            "host_us_by_phase": {
                p: statistics.median(r["host_us_by_phase"].get(p, 0.0) for r in runs)
                for p in sorted(phases)
            },
            "accepted": runs[-1]["accepted"],
            "proposed": runs[-1]["proposed"],
            "probed": runs[-1]["probed"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", nargs="+", default=["gemma4", "qwen_gdn"])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--accuracies", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    for family in args.family:
        result = profile(
            family, args.depth, args.tokens, args.reps, tuple(args.accuracies),
            size=args.size, dtype=args.dtype,
        )  # fmt: skip
        print(json.dumps(result))
        off = result["off"]
        line = (
            f"# {family} depth {args.depth}, verify/step kernels {result['kernels']}: host us/token "
            f"(wall) off {off['host_us_per_token']:.0f} ({off['wall_us_per_token']:.0f})"
        )
        for name, on in result.items():
            if name.startswith("drafted_"):
                line += (
                    f"; {name[8:]} {on['host_us_per_token']:.0f} ({on['wall_us_per_token']:.0f}) "
                    f"{on['accepted']}/{on['proposed']} accepted, {on['probed']} probed"
                )
        print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
