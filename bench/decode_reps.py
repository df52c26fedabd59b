"""A lone row's library decode of one install, repeated in one process: each repetition's tok/s.

For A/Bs of a process-wide setting (MLX's environment variables such as
``MLX_MAX_OPS_PER_BUFFER`` or ``MLX_USE_CUDA_GRAPHS``, read once a process;
our kernels' switches, read at import): run this once per setting, each in a
fresh process, alternating, and compare the repetitions. On the GPU the
machines' hosts differ, and one process's rate can move by more than a setting
moves it, so several processes a setting say more than one.

The engine loads *path* (:func:`bench.forward.opened`), then each repetition
prefills the same random prompt in chunks and greedy-decodes through its
library loop (ours: ``stream_generate``; mlx-lm's: ``generate_step``), timed
from the first decoded token; the first repetition warms up (traces, kernels
compiled) and is left out. On a GPU each repetition's clocks, power and
temperature, read as it ended (:func:`bench.common.gpu_state`), come with
it, so a slow one can be told from a clock held down.

Run: ``python -m bench.decode_reps INSTALL [--engine ours|mlx_lm] [--prompt-tokens 2048]
[--tokens 128] [--chunk 512] [--reps 3]``; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import gpu_state
from bench.forward import _ours_generate, _theirs_generate, opened

ENGINES = ("ours", "mlx_lm")


def decode_reps(
    path: Path, engine: str, *, prompt_tokens: int, tokens: int, chunk: int, reps: int
) -> dict[str, Any]:
    """*reps* timed repetitions of *engine*'s library decode of *tokens* after
    a prompt of *prompt_tokens*, after one untimed: tok/s each, and whether
    every repetition decoded the same ids (greedy, the same prompt: they must)."""
    handle, _, prompt = opened(path, engine, prompt_tokens, prompt_tokens + tokens + 2)
    if engine == "ours":
        run = _ours_generate(handle, path, prompt, tokens, chunk)
    else:
        run = _theirs_generate(handle, prompt, tokens, chunk)
    run()
    samples, gpu = [], []
    for _ in range(reps):
        samples.append(run())
        gpu.append(gpu_state())
    out = {
        "engine": engine,
        "install": path.name,
        "tok_s": [round(tokens / s["decode_s"], 1) for s in samples],
        "same_tokens": all(s["tokens"] == samples[0]["tokens"] for s in samples),
    }
    if any(gpu):  # each repetition's clocks, read as it ended
        out["gpu"] = gpu
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, metavar="INSTALL")
    parser.add_argument("--engine", choices=ENGINES, default="ours")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens a repetition")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions, after one warm-up")
    args = parser.parse_args(argv)
    counts = {name: getattr(args, name) for name in ("prompt_tokens", "tokens", "chunk", "reps")}
    for name, value in counts.items():
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    print(json.dumps(decode_reps(args.path, args.engine, **counts)))


if __name__ == "__main__":
    main()
