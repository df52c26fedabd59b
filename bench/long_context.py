"""Long prompts against mlx-lm: decode speed, step spikes and memory as the context grows.

For each prompt length, each engine runs in a **fresh process** (so one's
buffers, caches and compiled traces never count for the other, and the peak
is the run's own): it loads the install, prefills the prompt in chunks of the
plan's size and greedy-decodes through its library generation loop
(:func:`bench.forward._ours_generate`, :func:`bench.forward._theirs_generate`:
``stream_generate`` against mlx-lm's ``generate_step``), and reports

- ``decode_tok_s``: decode tokens over the time after the first token;
- ``first16_s``: the first 16 decode tokens' time (traces a first step
  builds, buffers grown at the prompt's end);
- ``max_over_median_step``: the slowest decode step over the median one,
  after the first :data:`SETTLE` (the issue's target: no step at any context
  length past 2x the steady step);
- ``loaded_bytes``: MLX's active memory after the load; ``load_peak_bytes``
  its peak by then; ``peak_bytes``: its peak over the load and the run
  (``mx.get_peak_memory``): resident weights, K/V and whatever the prompt's
  forwards held at once.

Ratios are ours ÷ mlx-lm; ``tokens_match`` says both decoded the same ids
(the comparison's premise: same weights, same greedy tokens).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from bench.forward import _ours_generate, _theirs_generate, opened

SETTLE = 4  # decode steps left out of the spike ratio: traces built, buffers grown
FIRST = 16  # the decode tokens whose time is reported on their own
ENGINES = ("ours", "mlx_lm")


def run_engine(
    engine: str, path: Path, prompt_tokens: int, decode_tokens: int, chunk: int
) -> dict[str, Any]:
    """One engine's row in a fresh process (see :func:`_child`)."""
    args = [str(path), engine, str(prompt_tokens), str(decode_tokens), str(chunk)]
    out = subprocess.run(
        [sys.executable, "-m", "bench.long_context", *args],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],  # where ``bench`` imports from
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(path: Path, engine: str, prompt_tokens: int, decode_tokens: int, chunk: int) -> None:
    import mlx.core as mx

    start = time.perf_counter()
    handle, loaded, prompt = opened(path, engine, prompt_tokens, prompt_tokens + decode_tokens + 2)
    if engine == "ours":
        run = _ours_generate(handle, path, prompt, decode_tokens, chunk)
    else:
        run = _theirs_generate(handle, prompt, decode_tokens, chunk)
    load_s = time.perf_counter() - start
    load_peak = mx.get_peak_memory()
    sample = run()
    print(
        json.dumps(
            {
                "load_s": load_s,
                "loaded_bytes": loaded,
                "load_peak_bytes": load_peak,
                "peak_bytes": mx.get_peak_memory(),
                **sample,
            }
        )
    )


def summarise(sample: dict[str, Any], decode_tokens: int) -> dict[str, Any]:
    """A child's sample as the row's figures (the arrivals become per-step times)."""
    arrivals = sample.pop("arrivals_s")
    steps = [b - a for a, b in pairwise(arrivals)]
    steady = steps[SETTLE:] or steps
    median = statistics.median(steady)
    return {
        **sample,
        "decode_tok_s": decode_tokens / sample["decode_s"],
        "first16_s": sum(steps[:FIRST]),
        "median_step_s": median,
        "max_step_s": max(steady),
        "max_over_median_step": max(steady) / median,
        "step_s": steps,
    }


def bench_long_context(
    path: Path, *, prompt_lengths: tuple[int, ...], decode_tokens: int, chunk: int
) -> dict[str, Any]:
    """Every prompt length's row for *path*: both engines, each in its own process."""
    rows = []
    for length in prompt_lengths:
        engines = {
            engine: summarise(run_engine(engine, path, length, decode_tokens, chunk), decode_tokens)
            for engine in ENGINES
        }
        ours, theirs = engines["ours"], engines["mlx_lm"]
        rows.append(
            {
                "prompt_tokens": length,
                "engines": engines,
                "tokens_match": ours.pop("tokens") == theirs.pop("tokens"),
                "decode_ratio_vs_mlx_lm": ours["decode_tok_s"] / theirs["decode_tok_s"],
                "prefill_ratio_vs_mlx_lm": theirs["prefill_s"] / ours["prefill_s"],
                "first16_ratio_vs_mlx_lm": ours["first16_s"] / theirs["first16_s"],
                "peak_memory_ratio_vs_mlx_lm": ours["peak_bytes"] / theirs["peak_bytes"],
                "loaded_memory_ratio_vs_mlx_lm": ours["loaded_bytes"] / theirs["loaded_bytes"],
            }
        )
    return {"decode_tokens": decode_tokens, "chunk": chunk, "settle_steps": SETTLE, "rows": rows}


def summary(result: dict[str, Any]) -> list[str]:
    """One line a prompt length, for ``bench.run`` and ``bench.report``."""
    lines = []
    for row in result["rows"]:
        ours, theirs = row["engines"]["ours"], row["engines"]["mlx_lm"]
        lines.append(
            f"prompt {row['prompt_tokens']:6d}: decode {ours['decode_tok_s']:8.1f} tok/s "
            f"(mlx-lm {theirs['decode_tok_s']:8.1f}, x{row['decode_ratio_vs_mlx_lm']:.2f}), "
            f"peak {ours['peak_bytes'] / 1e9:.3f} GB (mlx-lm {theirs['peak_bytes'] / 1e9:.3f}, "
            f"x{row['peak_memory_ratio_vs_mlx_lm']:.2f}), max/median step "
            f"{ours['max_over_median_step']:.2f} (mlx-lm {theirs['max_over_median_step']:.2f}), "
            f"first {FIRST} {ours['first16_s'] * 1e3:.0f} ms "
            f"(mlx-lm {theirs['first16_s'] * 1e3:.0f}), tokens match: {row['tokens_match']}"
        )
    return lines


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2], *(int(a) for a in sys.argv[3:6]))
