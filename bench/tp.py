"""Tensor parallelism: sharded against unsharded logits, TP=N against TP=1 tok/s.

    python bench/tp.py OUT [--family F ...] [--size tp8b] [--n 2] [--backend nccl]

On a 2-GPU host (``nvidia-h200-x2``) with the defaults: the ~8B synthetic
shape (``common._TP8B``: hidden 4096, 32 layers, bf16), prefill of 2048
tokens in chunks of 512 and 128 greedy decode steps (``forward.py``'s hand
loop, one warm-up then ``--reps`` timed, medians), first in one process
(TP=1), then under ``mlx.launch -n N --backend nccl`` (every rank times the
same loop; rank 0's numbers are reported). Each rank also compares its
sharded logits with an unsharded copy of the model on the same prompt (TP=1
memory per GPU: the unsharded copy must fit one GPU, as 8B in bf16 does).
Target: TP=2 decode ≥ 1.5x TP=1.

On the CPU, ``--size small --backend ring --dtype float32`` is the same run
on two processes over loopback (a smoke check; CPU ranks share the cores).
One JSON line per family is appended to ``tp.jsonl`` in OUT as soon as it exists.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT, DECODE, CHUNK = 2048, 128, 512


def measure(path: Path, dtype: str, reps: int, compare: bool, backend: str) -> dict[str, Any]:
    """One rank's numbers: tok/s of the (possibly sharded) model, and with
    *compare* the max |sharded - unsharded| over the prompt's last logits."""
    import mlx.core as mx

    from bench.common import random_tokens
    from bench.forward import _ours_loop
    from turbospark import Runner

    group = mx.distributed.init(backend=backend)  # a group of one without a launcher
    runner = Runner.open(path, context_length=PROMPT + DECODE + 2, dtype=dtype, group=group)
    prompt = random_tokens(PROMPT, runner.vocab_size, seed=1)
    loop = _ours_loop(runner, prompt, DECODE, CHUNK)
    loop()  # warm-up: compiles and first-shape work
    samples = [loop() for _ in range(reps)]
    prefill = sorted(s["prefill_s"] for s in samples)[len(samples) // 2]
    decode = sorted(s["decode_s"] for s in samples)[len(samples) // 2]
    result: dict[str, Any] = {
        "rank": group.rank(),
        "size": group.size(),
        "prefill_tok_s": PROMPT / prefill,
        "decode_tok_s": DECODE / decode,
        "session_bytes_per_token": runner.session_nbytes()[0] / (PROMPT + DECODE),
    }
    if compare and group.size() > 1:
        runner.reset()
        sharded = runner.prefill_chunk(prompt[:CHUNK], 0)
        del runner
        whole = Runner.open(path, context_length=CHUNK + 2, dtype=dtype)
        reference = whole.prefill_chunk(prompt[:CHUNK], 0)
        diff = mx.abs(sharded.astype(mx.float32) - reference.astype(mx.float32))
        result["max_abs_logit_diff"] = diff.max().item()
        result["max_abs_logit"] = mx.abs(reference.astype(mx.float32)).max().item()
        result["same_argmax"] = bool((mx.argmax(sharded) == mx.argmax(reference)).item())
    return result


def worker(args: argparse.Namespace) -> None:
    """One rank (alone, or under mlx.launch): print one JSON line."""
    result = measure(args.install, args.dtype, args.reps, compare=True, backend=args.backend)
    if result["rank"] == 0:
        print("TP-RESULT " + json.dumps(result), flush=True)


def run_ranks(install: Path, n: int, backend: str, dtype: str, reps: int) -> dict[str, Any]:
    """The worker on *n* processes (1: plain, no launcher); rank 0's line."""
    here = Path(__file__).resolve()
    argv = [here.as_posix(), "--worker", str(install), "--dtype", dtype, "--reps", str(reps)]
    argv += ["--backend", backend if n > 1 else "any"]
    if n == 1:
        command = [sys.executable, *argv]
    else:
        launch = Path(sys.executable).parent / "mlx.launch"
        command = [str(launch), "-n", str(n), "--backend", backend, "--", sys.executable, *argv]
    done = subprocess.run(command, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("TP-RESULT "):
            return json.loads(line.removeprefix("TP-RESULT "))
    raise RuntimeError(f"TP={n} run failed ({done.returncode}):\n{done.stderr[-3000:]}")


def bench_tp(
    family: str, size: str, n: int, backend: str, dtype: str, reps: int, cache_dir: Path
) -> dict[str, Any]:
    from bench.common import install

    path = install(family, size, dtype, cache_dir)
    one = run_ranks(path, 1, backend, dtype, reps)
    many = run_ranks(path, n, backend, dtype, reps)
    return {
        "family": family,
        "size": size,
        "dtype": dtype,
        "tp1": one,
        f"tp{n}": many,
        "decode_speedup": many["decode_tok_s"] / one["decode_tok_s"],
        "prefill_speedup": many["prefill_tok_s"] / one["prefill_tok_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--worker", type=Path, dest="install", help=argparse.SUPPRESS)
    parser.add_argument("--family", action="append", choices=["gemma4", "qwen_gdn"])
    parser.add_argument("--size", default="tp8b")
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--backend", default="nccl", choices=["nccl", "ring", "any"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/bench-cache"))
    args = parser.parse_args()
    if args.install is not None:
        worker(args)
        return
    if args.out is None:
        parser.error("OUT is required")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "tp.jsonl").open("a") as sink:
        for family in args.family or ["gemma4", "qwen_gdn"]:
            started = time.perf_counter()
            result = bench_tp(
                family, args.size, args.n, args.backend, args.dtype, args.reps, args.cache_dir
            )
            result["seconds"] = time.perf_counter() - started
            print(json.dumps(result), flush=True)
            sink.write(json.dumps(result) + "\n")
            sink.flush()


if __name__ == "__main__":
    main()
