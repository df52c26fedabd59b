"""Quantized checkpoints against mlx-lm: the same ``mlx_lm.convert -q`` directory for both.

The float install is converted once per bit width by mlx-lm's own converter
(``python -m mlx_lm convert -q``), so both engines read byte-identical packed
weights; turbospark opens the converted directory as it is (no import).

For each of the float install and its 8- and 4-bit conversions:

- ``forward``: :func:`bench.forward.bench_forward` (prefill and decode tok/s,
  hand loop and both libraries' generation loops, ratios ours ÷ mlx-lm);
- ``memory``: each engine in a fresh process loads the directory, prefills
  the prompt and decodes, and reports MLX's active memory after the load
  (``loaded_bytes``), its peak by then (``load_peak_bytes``: the load and, where
  the attention kernels run, its warm-up) and its peak over the load and the
  run (``peak_bytes``, ``mx.get_peak_memory``): resident weights plus what the
  forward needed;
- ``concurrency`` (when a plan is given): :func:`bench.concurrency.bench_concurrency`
  at the plan's client counts, both servers on the converted directory.

``decode_vs_float`` is each width's library decode over our float decode of
the same shape: what quantizing buys on this device.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.concurrency import ConcurrencyPlan, bench_concurrency
from bench.forward import _ours_loop, _theirs_loop, bench_forward, opened

BITS = (8, 4)
GROUP_SIZE = 64  # mlx-lm's default, and mlx-community's usual


def converted(base: Path, bits: int, group_size: int = GROUP_SIZE) -> Path:
    """*base* quantized by ``mlx_lm.convert`` (built once, beside it)."""
    out = base.parent / f"{base.name}-q{bits}g{group_size}"
    if not (out / "config.json").is_file():
        args = ["--hf-path", str(base), "--mlx-path", str(out), "-q"]
        args += ["--q-bits", str(bits), "--q-group-size", str(group_size)]
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", *args], check=True)
    return out


def memory(engine: str, path: Path, prompt_tokens: int, decode_tokens: int) -> dict[str, float]:
    """One engine's memory in a fresh process (see :func:`_memory_child`)."""
    args = [str(path), engine, str(prompt_tokens), str(decode_tokens)]
    out = subprocess.run(
        [sys.executable, "-m", "bench.quantized", *args], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _memory_child(path: Path, engine: str, prompt_tokens: int, decode_tokens: int) -> None:
    import mlx.core as mx

    start = time.perf_counter()
    handle, loaded, prompt = opened(path, engine, prompt_tokens, prompt_tokens + decode_tokens + 2)
    if engine == "ours":
        run = _ours_loop(handle, prompt, decode_tokens, chunk=prompt_tokens)
    else:
        run = _theirs_loop(handle, prompt, decode_tokens, chunk=prompt_tokens)
    load_peak = mx.get_peak_memory()
    run()  # the prompt in one chunk, then greedy decode: bench.forward's hand loops
    print(
        json.dumps(
            {
                "loaded_bytes": loaded,
                "load_peak_bytes": load_peak,
                "peak_bytes": mx.get_peak_memory(),
                "wall_s": time.perf_counter() - start,
            }
        )
    )


def bench_quantized(
    base: Path,
    *,
    prompt_tokens: int,
    decode_tokens: int,
    chunk: int,
    reps: int,
    log_dir: Path,
    concurrency: ConcurrencyPlan | None = None,
    bits: tuple[int, ...] = BITS,
    cache_limit: str | None = None,
) -> dict[str, Any]:
    """Every row above for *base* (a float install) and its conversions; the
    servers of ``concurrency`` with MLX's buffer cache bounded to *cache_limit*."""
    rows: dict[str, Any] = {}
    paths = {"float": base, **{f"q{b}": converted(base, b) for b in bits}}
    for name, path in paths.items():
        row: dict[str, Any] = {
            "path": path.name,
            "forward": bench_forward(
                path,
                prompt_tokens=prompt_tokens,
                decode_tokens=decode_tokens,
                chunk=chunk,
                reps=reps,
                library_loops=True,
            ),
            "memory": {
                engine: memory(engine, path, prompt_tokens, decode_tokens)
                for engine in ("ours", "mlx_lm")
            },
        }
        mem = row["memory"]
        row["peak_memory_ratio_vs_mlx_lm"] = mem["ours"]["peak_bytes"] / mem["mlx_lm"]["peak_bytes"]
        row["loaded_memory_ratio_vs_mlx_lm"] = (
            mem["ours"]["loaded_bytes"] / mem["mlx_lm"]["loaded_bytes"]
        )
        if concurrency is not None and name != "float":
            row["concurrency"] = bench_concurrency(
                path, concurrency, log_dir / name, cache_limit=cache_limit
            )
        rows[name] = row
    float_decode = rows["float"]["forward"]["engines"]["ours_generate"]["decode_tok_s"]
    for row in rows.values():
        row["decode_vs_float"] = (
            row["forward"]["engines"]["ours_generate"]["decode_tok_s"] / float_decode
        )
    return {"group_size": GROUP_SIZE, "rows": rows}


if __name__ == "__main__":
    _memory_child(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
