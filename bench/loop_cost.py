"""Host µs per token that the generation loop spends around the forward.

``Runner.produce`` is replaced, on one runner, by a stub that returns ready
logits (no forward, nothing to wait for), so what is timed is the loop's own
per-token work: :func:`turbospark.generation.generate.stream_generate` (sampling,
detokenizing, stop strings, chunks) against a bare loop that only reads each
id (``int(mx.argmax(logits).item())``, the forward benchmark's hand loop).
On a launch-bound GPU this work is added to every step it does not overlap::

    uv run python bench/loop_cost.py qwen_gdn [--tokens 2000] [--reps 5] [--stop STR ...]

It uses only public APIs and ``bench.common``, so it runs unchanged against
an older checkout (put that checkout first on ``PYTHONPATH``) for a before/after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

from bench.common import DEFAULT_CACHE, install, random_tokens
from turbospark.generation.generate import GenerationConfig, stream_generate
from turbospark.generation.runner import Runner
from turbospark.text import load_text


def stub_forward(runner: Runner) -> None:
    """Make *runner*'s ``produce`` and ``feed`` return one of 64 ready logits
    rows (the sampler applied, as the real ones do); nothing to take back."""
    rows = [mx.random.normal((runner.vocab_size,), key=mx.random.key(i)) for i in range(64)]
    mx.eval(rows)
    count = iter(range(10**12))

    def produce(token: object, position: int, then=None) -> mx.array:
        logits = rows[next(count) % len(rows)]
        return logits if then is None else then(logits)

    def feed(session: object, tokens: object, start: int, logits=False, then=None):
        return produce(tokens, start, then) if logits else None

    runner.produce = produce  # type: ignore[method-assign]
    runner.take_back = lambda: None  # type: ignore[method-assign]
    # The engine's one-row steps (what stream_generate runs) feed a checked-out session.
    runner.feed = feed  # type: ignore[method-assign]
    runner.take_back_session = lambda session: None  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("family", choices=["gemma4", "qwen_gdn"])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--stop", nargs="*", default=[], help="stop strings for the library loop")
    args = parser.parse_args()
    path = install(args.family, "chat", "float32", DEFAULT_CACHE)  # every id decodes to text
    runner = Runner.open(path, context_length=args.tokens + 64)
    codec = load_text(path)
    prompt = random_tokens(16, runner.vocab_size, seed=1)
    stub_forward(runner)
    n = args.tokens

    def bare() -> float:
        started, token = time.perf_counter(), 0
        for i in range(n):
            token = int(mx.argmax(runner.produce(token, i)).item())
        return (time.perf_counter() - started) / n * 1e6

    def library() -> float:
        config = GenerationConfig(max_tokens=n + 1, stop_token_ids=[], stop=args.stop)
        started = None
        for _ in stream_generate(runner, codec, prompt, config):
            if started is None:  # the first token ends the prefill
                started = time.perf_counter()
        return (time.perf_counter() - started) / n * 1e6

    samples: dict[str, list[float]] = {"bare": [], "stream_generate": []}
    for rep in range(args.reps + 1):  # rep 0 warms both up
        for name, run in (("bare", bare), ("stream_generate", library)):
            value = run()
            if rep:
                samples[name].append(value)
    for name, values in samples.items():
        print(
            f"{args.family} {name}: host µs per token median {statistics.median(values):.1f}, "
            f"min {min(values):.1f}"
        )


if __name__ == "__main__":
    main()
