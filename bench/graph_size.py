"""Decode tok/s of both library loops against MLX's CUDA-graph size.

MLX's CUDA backend records kernels into CUDA graphs and launches one graph
every ``MLX_MAX_OPS_PER_BUFFER`` kernels (20 unless set; ``MLX_USE_CUDA_GRAPHS=0``
launches each kernel alone). A decode step of a ~1B model is ~400–500 kernels
and host-bound on the H200, so the per-graph host cost is paid 20–25 times a
token. MLX reads the variable once per process, so each setting runs in a
process of its own; the settings alternate over rounds so that the machine's
drift hits them all alike. Both engines run in every process, under the same
setting, and the ratio is always within one process::

    python bench/graph_size.py INSTALL [--settings default 60 200 off] [--rounds 2]

Each process: one warm-up of each loop, then ``--reps`` interleaved runs of
``stream_generate`` and mlx-lm's ``generate_step`` (512-token prompt, 128
decoded tokens); the result per setting is the median over every run of every
round, with the spread (max − min) ÷ median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

SETTINGS = {"default": {}, "off": {"MLX_USE_CUDA_GRAPHS": "0"}}


def env_of(setting: str) -> dict[str, str]:
    """``default``, ``off`` or a number of kernels per graph."""
    if setting in SETTINGS:
        return SETTINGS[setting]
    return {"MLX_MAX_OPS_PER_BUFFER": str(int(setting))}


def one_process(path: Path, reps: int) -> dict[str, list[float]]:
    """Both loops' decode tok/s in this process (its MLX settings as set)."""
    from mlx_lm.utils import load_model

    from bench.common import random_tokens
    from bench.forward import _ours_generate, _theirs_generate
    from turbospark.generation.runner import Runner

    runner = Runner.open(path, context_length=1024)
    model, _ = load_model(path)
    prompt = random_tokens(512, runner.vocab_size, seed=1)
    loops = {
        "ours": _ours_generate(runner, path, prompt, 128, 512),
        "mlx_lm": _theirs_generate(model, prompt, 128, 512),
    }
    for run in loops.values():
        run()
    rows: dict[str, list[float]] = {name: [] for name in loops}
    for rep in range(reps):
        for name in list(loops) if rep % 2 == 0 else list(loops)[::-1]:
            rows[name].append(128 / loops[name]()["decode_s"])
    return rows


def bench_graph_size(
    path: Path, settings: list[str], rounds: int, reps: int, timeout: float = 120
) -> dict[str, Any]:
    """Every setting in its own process, *rounds* times, alternating."""
    runs: dict[str, dict[str, list[float]]] = {s: {"ours": [], "mlx_lm": []} for s in settings}
    failed: dict[str, str] = {}
    root = Path(__file__).resolve().parent.parent
    for _ in range(rounds):
        for setting in settings:
            env = {**os.environ, **env_of(setting)}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
            try:
                done = subprocess.run(
                    [sys.executable, __file__, str(path), "--child", "--reps", str(reps)],
                    env=env, capture_output=True, text=True, timeout=timeout, check=True,
                )  # fmt: skip
            except (subprocess.SubprocessError, OSError) as error:
                failed[setting] = str(error)[-300:]
                continue
            rows = json.loads(done.stdout.strip().splitlines()[-1])
            for name, values in rows.items():
                runs[setting][name] += values
    result: dict[str, Any] = {"settings": {}, "failed": failed}
    for setting, rows in runs.items():
        if not rows["ours"]:
            continue
        medians = {name: statistics.median(v) for name, v in rows.items()}
        result["settings"][setting] = {
            "env": env_of(setting),
            "decode_tok_s": medians,
            "spread": {n: (max(v) - min(v)) / medians[n] for n, v in rows.items()},
            "ratio_vs_mlx_lm": medians["ours"] / medians["mlx_lm"],
            "runs": rows,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("install", type=Path)
    parser.add_argument("--settings", nargs="+", default=["default", "60", "200", "off"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_process(args.install, args.reps)))
        return
    print(json.dumps(bench_graph_size(args.install, args.settings, args.rounds, args.reps)))


if __name__ == "__main__":
    main()
