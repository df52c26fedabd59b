"""Where the device's time goes: every kernel MLX runs on a GPU, timed by CUPTI.

MLX's CUDA backend has no kernel timer, and Nsight Systems cannot build a
report on the lent machines (their tool notes say so). CUPTI's activity
records cover the whole process, though: PyTorch's profiler, started in the
process that runs MLX, records every kernel the device runs (MLX's, launched
from its CUDA graphs, included) and every CUDA runtime and driver call made on
the host. A window of MLX work inside ``torch.profiler.profile`` therefore says,
per window (:func:`summarise`):

- ``kernels`` / ``kernel_us``: launches and their summed device time;
  ``busy_us``: the union of the kernels' intervals, against ``wall_us``: a
  device idle for much of a window waits on the host that builds its work;
- ``top_kernels``: kernels by summed time (name cut at its template
  arguments, launches, µs), what to make cheaper;
- ``api``: the host's calls into CUDA by summed time (graph instantiation and
  launches, module loads, allocations, synchronisation), what a window's host
  time is spent inside CUDA on.

Four kinds of window:

1. **decode**: ``--tokens`` greedy tokens of our library loop
   (:func:`turbospark.generation.generate.stream_generate`) and of mlx-lm's
   ``generate_step`` on the same install, after a warm-up request of each
   (issue 17: how far each step is from the bandwidth limit, and in what);
   the summary is also given per token.
2. **prefill**: a batched prefill forward per ``(rows, new tokens, held)``
   case (:func:`bench.prefill_cost.timed_forward`, as a server's prefill
   group runs it), the first time its shape runs and at once again (issue 10:
   where the first time's extra 20-80 ms goes: into kernels that run longer,
   or into host calls, and which).
3. **batch**: ``--steps`` of the engine's batched decode step with ``--rows``
   ragged rows, each holding about ``--prompt-tokens`` (``bench.step_cost``'s
   requests, every row in the merged state first), per step. A device busy
   for the step's wall time says the step waits on the device; one idle for
   most of it, on the host (on the H200, a 16-row gemma4 step at 320 tokens a
   row kept it busy 54 % of the step: bench/README.md, sixteenth session).

4. **kernels**: our own CUDA kernels alone, ``--calls`` calls of each at a
   decode step's shapes (:data:`ATTENTION_CASES`, :data:`JOIN_NORM_CASES`),
   on synthetic bf16 arrays, no install: each kernel's mean device time, to
   compare two versions of a kernel (each tree's packages first on
   ``PYTHONPATH``, one process each) or ``--chunks`` of the attention's
   partial kernel in one process.

Run on a GPU machine whose Python has PyTorch (the lent H200's ``python3``):
``python3 bench/device_trace.py decode --family qwen_gdn --size large``,
``python3 bench/device_trace.py prefill --family gemma4 --size chat_large``,
``python3 bench/device_trace.py batch --family gemma4 --size chat_large
--rows 16 --prompt-tokens 320``, ``python3 bench/device_trace.py kernels --chunks 16 32``;
``--json`` for the raw summary. Only :func:`summarise` runs without a GPU
(it reads a Chrome trace, as ``torch.profiler`` exports it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNEL_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
API_CATEGORIES = {"cuda_runtime", "cuda_driver"}


def short_name(name: str) -> str:
    """A kernel's name without template or call arguments, so one kernel's
    instances (dtypes, sizes) group together; cuBLAS's own names pass whole."""
    cut = re.split(r"[<(]", name, maxsplit=1)[0].strip()
    return cut.removeprefix("void ").strip() or name[:80]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for begin, finish in sorted(intervals):
        if finish <= end:
            continue
        busy += finish - max(begin, end)
        end = finish
    return busy


def summarise(events: list[dict[str, Any]], wall_us: float, top: int = 15) -> dict[str, Any]:
    """One window's device and CUDA-API time from a Chrome trace's events."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in KERNEL_CATEGORIES]
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") in API_CATEGORIES]
    by_kernel: dict[str, list[float]] = defaultdict(list)
    launch: dict[str, list[int]] = {}  # a kernel's first grid and block, a hint of its shape
    for e in kernels:
        name = short_name(e["name"])
        by_kernel[name].append(float(e["dur"]))
        args = e.get("args", {})
        launch.setdefault(name, [*args.get("grid", []), *args.get("block", [])])
    by_call: dict[str, list[float]] = defaultdict(list)
    for e in calls:
        by_call[e["name"]].append(float(e["dur"]))
    ranked = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))
    return {
        "wall_us": round(wall_us, 1),
        "kernels": len(kernels),
        "kernel_us": round(sum(float(e["dur"]) for e in kernels), 1),
        "busy_us": round(_union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels]), 1),
        "top_kernels": [
            {
                "name": name,
                "n": len(d),
                "us": round(sum(d), 1),
                "mean_us": round(sum(d) / len(d), 2),
                "grid_block": launch[name],
            }
            for name, d in ranked[:top]
        ],
        "api": [
            {"name": name, "n": len(d), "us": round(sum(d), 1), "max_us": round(max(d), 1)}
            for name, d in sorted(by_call.items(), key=lambda kv: -sum(kv[1]))[:top]
        ],
    }


def per_token(summary: dict[str, Any], tokens: int) -> dict[str, float]:
    """A decode window's totals divided by its tokens."""
    keys = ("wall_us", "kernels", "kernel_us", "busy_us")
    return {k: round(summary[k] / tokens, 2) for k in keys}


@contextmanager
def traced(out: dict[str, Any], top: int = 15) -> Iterator[None]:
    """Profile the body (every kernel and CUDA call in the process) and put its
    :func:`summarise` into *out*; the body must synchronise before it ends."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        raise SystemExit(
            "device_trace needs PyTorch's profiler in the Python that runs MLX on the GPU "
            "(the lent H200's python3 has it); install torch or run it there"
        ) from None

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        yield
        wall = (time.perf_counter() - began) * 1e6
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    out.update(summarise(events, wall, top))


def decode(path: Path, tokens: int, prompt_tokens: int, top: int) -> dict[str, Any]:
    """Our ``stream_generate`` and mlx-lm's ``generate_step``, *tokens* each, traced."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from bench.common import random_tokens
    from turbospark.generation.generate import GenerationConfig, stream_generate
    from turbospark.generation.runner import Runner
    from turbospark.text import load_text

    runner = Runner.open(path, context_length=prompt_tokens + 2 * tokens + 64)
    prompt = random_tokens(prompt_tokens, runner.vocab_size, seed=0)
    codec = load_text(path)
    config = GenerationConfig(max_tokens=tokens, stop_token_ids=[], chunk_size=512)

    def ours() -> Callable[[], None]:
        stream = stream_generate(runner, codec, prompt, config)
        next(stream)  # prefill and the first token, outside the window

        def rest() -> None:
            for _ in stream:
                pass
            mx.synchronize()

        return rest

    model, _ = load_model(path)

    def theirs() -> Callable[[], None]:
        steps = generate_step(mx.array(prompt), model, max_tokens=tokens, prompt_cache=None, prefill_step_size=512)  # fmt: skip
        int(next(steps)[0])

        def rest() -> None:
            for token, _ in steps:
                int(token)
            mx.synchronize()

        return rest

    result: dict[str, Any] = {"tokens": tokens - 1, "prompt_tokens": prompt_tokens}
    for name, start in (("ours", ours), ("mlx_lm", theirs)):
        start()()  # warm-up: compiles and kernel loads outside the window
        rest = start()
        window: dict[str, Any] = {}
        with traced(window, top):
            rest()
        window["per_token"] = per_token(window, tokens - 1)
        result[name] = window
    runner.close()
    return result


def prefill(path: Path, cases: list[tuple[int, int, int]], top: int) -> list[dict[str, Any]]:
    """Each case's batched prefill forward traced the first time and again."""
    import numpy as np

    from bench.prefill_cost import timed_forward
    from turbospark.generation.runner import Runner

    runner = Runner.open(path, context_length=4096, session_slots=16)
    rng = np.random.default_rng(0)
    timed_forward(runner, rng, 1, 8, 0)  # the process's own first forward (its compiles)
    rows = []
    for batch, length, held in cases:
        row: dict[str, Any] = {"rows": batch, "tokens": length, "held": held}
        for label in ("first", "again"):
            window: dict[str, Any] = {}
            row[f"{label}_ms"] = round(timed_forward(runner, rng, batch, length, held, lambda w=window: traced(w, top)), 2)  # fmt: skip
            row[label] = window
        rows.append(row)
    runner.close()
    return rows


def batch(path: Path, rows: int, prompt_tokens: int, steps: int, top: int) -> dict[str, Any]:
    """*steps* batched decode steps of *rows* ragged rows (each holding about
    *prompt_tokens*), traced after the rows are merged and have stepped a while."""
    import mlx.core as mx

    from bench.step_cost import _engine, _jobs, merge

    engine, runner = _engine(path, rows)
    for job in _jobs(runner, rows, 3 * steps + 64, 0.0, prompt_tokens):
        engine.submit(job)
    merge(engine, rows)
    for _ in range(steps):  # outside the window: the step's graphs built at these shapes
        engine.step()
    mx.synchronize()
    window: dict[str, Any] = {}
    with traced(window, top):
        for _ in range(steps):
            engine.step()
        mx.synchronize()
    window["per_step"] = per_token(window, steps)
    runner.close()
    return {"rows": rows, "prompt_tokens": prompt_tokens, "steps": steps, "window": window}


# (kv_heads, group, head dim, buffer rows, rows attended): a 2,048-token
# prompt's decode at the large sizes, Gemma 4's global layers and qwen_gdn's.
ATTENTION_CASES = [(2, 4, 512, 2304, 2176), (2, 8, 256, 2304, 2176)]
# (width, with the update's norm, with a scale): the forms the families call
# (gemma4's two, qwen_gdn's plain join), each with the joined stream's norm.
JOIN_NORM_CASES = [(2048, True, True), (2048, True, False), (2048, False, False)]


def kernels(calls: int, chunks: list[int], top: int) -> list[dict[str, Any]]:
    """Each of :data:`ATTENTION_CASES` (at each of *chunks* keys a block) and
    :data:`JOIN_NORM_CASES`, *calls* calls traced after three warm-ups: the
    kernels' mean device time."""
    import mlx.core as mx

    from turbospark.layers.cuda import attention as attention_cuda
    from turbospark.layers.cuda import norm as norm_cuda

    def window(kernel: Callable[..., Any], *args: Any) -> dict[str, Any]:
        for _ in range(3):
            mx.eval(kernel(*args))
        traced_window: dict[str, Any] = {}
        with traced(traced_window, top):
            for _ in range(calls):
                mx.eval(kernel(*args))
            mx.synchronize()
        return {k["name"]: k["mean_us"] for k in traced_window["top_kernels"]}

    mx.random.seed(0)
    rows = []
    default_chunk = attention_cuda.CHUNK
    for chunk in chunks:
        attention_cuda.CHUNK = chunk  # read by decode() at each call
        for kv_heads, group, dim, capacity, stop in ATTENTION_CASES:
            q = mx.random.normal((1, kv_heads * group, 1, dim)).astype(mx.bfloat16)
            k, v = (mx.random.normal((1, kv_heads, capacity, dim)).astype(mx.bfloat16) for _ in "kv")  # fmt: skip
            bounds = mx.array([0, stop], dtype=mx.int32)
            mean = window(attention_cuda.decode, q, k, v, bounds, dim**-0.5)
            case = {"kv_heads": kv_heads, "group": group, "dim": dim, "rows": stop}
            rows.append({"kernel": "attention", "chunk": chunk, **case, "mean_us": mean})
    attention_cuda.CHUNK = default_chunk
    for width, update_norm, scale in JOIN_NORM_CASES:
        h, update, weight, update_weight = (mx.random.normal((width,)).astype(mx.bfloat16) for _ in range(4))  # fmt: skip
        h, update = h.reshape(1, 1, width), update.reshape(1, 1, width)
        factor = mx.array([0.5], dtype=mx.bfloat16) if scale else None
        extra = update_weight if update_norm else None
        mean = window(norm_cuda.join_norm, h, update, weight, 1e-6, extra, factor)
        case = {"width": width, "update_norm": update_norm, "scale": scale}
        rows.append({"kernel": "join_norm", **case, "mean_us": mean})
    return rows


def _case(text: str) -> tuple[int, int, int]:
    rows, tokens, held = (int(x) for x in text.split(","))
    return rows, tokens, held


def _print(name: str, window: dict[str, Any]) -> None:
    print(f"  {name}: wall {window['wall_us'] / 1e3:.2f} ms, {window['kernels']} kernels, "
          f"{window['kernel_us'] / 1e3:.2f} ms in kernels, device busy {window['busy_us'] / 1e3:.2f} ms")  # fmt: skip
    for k in window["top_kernels"]:
        print(f"    {k['us'] / 1e3:8.2f} ms {k['n']:6d}x {k['mean_us']:8.2f} us  {k['name'][:90]}")
    for a in window["api"][:8]:
        print(
            f"    api {a['us'] / 1e3:8.2f} ms {a['n']:6d}x (max {a['max_us'] / 1e3:.2f} ms)  {a['name']}"
        )


def main() -> None:
    from bench.common import install

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["decode", "prefill", "batch", "kernels"])
    parser.add_argument("--family", action="append")
    parser.add_argument("--size", default="large")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=65, help="decode: tokens a request")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--cases", nargs="+", type=_case, help="prefill: rows,tokens,held ...")
    parser.add_argument("--rows", type=int, default=16, help="batch: rows decoding together")
    parser.add_argument("--steps", type=int, default=50, help="batch: steps in the window")
    parser.add_argument("--calls", type=int, default=200, help="kernels: calls of each")
    parser.add_argument(
        "--chunks", nargs="+", type=int, help="kernels: keys a block (default CHUNK)"
    )
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/turbospark/bench")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from bench.prefill_cost import CASES

    if args.mode == "kernels":
        from turbospark.layers.cuda.attention import CHUNK

        for row in kernels(args.calls, args.chunks or [CHUNK], args.top):
            print(json.dumps({"piece": "device_trace_kernels", **row}), flush=True)
        return
    for family in args.family or ["gemma4", "qwen_gdn"]:
        path = install(family, args.size, args.dtype, args.cache_dir)
        line: dict[str, Any] = {
            "piece": f"device_trace_{args.mode}",
            "family": family,
            "size": args.size,
        }
        if args.mode == "decode":
            line["result"] = decode(path, args.tokens, args.prompt_tokens, args.top)
        elif args.mode == "batch":
            line["result"] = batch(path, args.rows, args.prompt_tokens, args.steps, args.top)
        else:
            line["result"] = prefill(path, args.cases or CASES, args.top)
        if args.json:
            print(json.dumps(line), flush=True)
            continue
        print(f"{family} {args.size} {args.mode}")
        if args.mode == "decode":
            for name in ("ours", "mlx_lm"):
                print(f" {name} per token: {line['result'][name]['per_token']}")
                _print(name, line["result"][name])
        elif args.mode == "batch":
            result = line["result"]
            print(f" {result['rows']} rows, ~{result['prompt_tokens']} held, per step: {result['window']['per_step']}")  # fmt: skip
            _print("steps", result["window"])
        else:
            for row in line["result"]:
                print(f" {row['rows']} x {row['tokens']}, held {row['held']}: first {row['first_ms']} ms, again {row['again_ms']} ms")  # fmt: skip
                _print("first", row["first"])
                _print("again", row["again"])


if __name__ == "__main__":
    main()
