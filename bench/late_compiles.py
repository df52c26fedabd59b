"""Kernels MLX compiles after ``turbospark serve`` says it is ready.

MLX compiles a kernel the first time an op graph runs: on CUDA with NVRTC,
seconds a module, into its PTX cache (``MLX_PTX_CACHE_DIR``); on the CPU with
the system compiler, into ``$TMPDIR/mlx/<version>/cpu``. ``serve`` warms itself
up so that real requests meet compiled kernels only (:meth:`Engine.warm_up
<turbospark.generation.engine.Engine.warm_up>`); a path its warm-up leaves out is
compiled by the first request that takes it, and every row batched with that
request waits. On the H200 a 16-client qwen_gdn server stalled 8-12 s that way
(bench/README.md, fourteenth session).

This starts ``turbospark serve`` with empty compile caches of its own, sends
the concurrency bench's traffic in its order (one chat request, a burst of
first turns from ``--clients`` clients, a 1-client chat, a ``--clients``-client
chat: :mod:`bench.concurrency`'s prompts and seeds) and lists every kernel file
written after the server was ready, each with the phase it was written in.
An empty list means the warm-up covered the traffic. Each phase's wall time and
completion tok/s say what a compile cost.

Run: ``uv run python bench/late_compiles.py --family qwen_gdn [--size chat] [--json]``;
on the GPU ``python3 bench/late_compiles.py --family qwen_gdn --size chat_large``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.common import DEFAULT_CACHE, install
from bench.concurrency import WARM_UP_TOKENS, ConcurrencyPlan, conversations, run_clients
from bench.serving import chat_request, running_server

PHASES = ("warm_up", "first_request", "burst", "one_client", "many_clients")


def phase_of(offset: float, ends: dict[str, float]) -> str:
    """The phase a file written *offset* seconds after the start belongs to:
    the first whose end (seconds after the start, in :data:`PHASES` order)
    it precedes; ``after`` past the last."""
    for name in PHASES:
        if name in ends and offset <= ends[name]:
            return name
    return "after"


def late_files(caches: list[Path], started: float, ends: dict[str, float]) -> list[dict[str, Any]]:
    """Kernel files in *caches* written after the warm-up ended, oldest first."""
    found = []
    for cache in caches:
        for path in cache.rglob("*"):
            offset = path.stat().st_mtime - started
            if path.is_file() and offset > ends["warm_up"]:
                found.append(
                    {"s": round(offset, 2), "phase": phase_of(offset, ends), "file": path.name}
                )
    return sorted(found, key=lambda row: row["s"])


def measure(path: Path, clients: int, log: Path) -> dict[str, Any]:
    """The traffic against a server with empty compile caches (see the module)."""
    root = Path(tempfile.mkdtemp(prefix="late-compiles-"))
    ptx, tmp = root / "ptx", root / "tmp"
    ptx.mkdir()
    tmp.mkdir()
    plan = ConcurrencyPlan(clients=(1, clients))
    body = {"ignore_eos": True}
    ends: dict[str, float] = {}
    rates: dict[str, dict[str, float]] = {}
    started = time.time()
    caches = {"MLX_PTX_CACHE_DIR": str(ptx), "TMPDIR": str(tmp)}  # the server inherits them
    with (
        patch.dict(os.environ, caches),
        running_server("turbospark", path, clients, log, ["--max-batch", str(clients)]) as base,
    ):
        ends["warm_up"] = time.time() - started
        warm = conversations(clients, plan, plan.seed - 1)  # the concurrency bench's seeds
        with httpx.Client(timeout=600.0) as http:
            chat_request(http, base, warm[0][0], WARM_UP_TOKENS, body)
        ends["first_request"] = time.time() - started
        run_clients(base, [c[:1] for c in warm], WARM_UP_TOKENS, body)
        ends["burst"] = time.time() - started
        for i, (name, n) in enumerate((("one_client", 1), ("many_clients", clients))):
            run = run_clients(
                base, conversations(n, plan, plan.seed + 100 * i), plan.reply_tokens, body
            )
            ends[name] = time.time() - started
            rates[name] = {"wall_s": run["wall_s"], "completion_tok_s": run["completion_tok_s"]}
    return {
        "clients": clients,
        "phase_ends_s": {name: round(t, 2) for name, t in ends.items()},
        "levels": rates,
        "late": late_files([ptx, tmp], started, ends),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen_gdn")
    parser.add_argument("--size", default="chat", help="bench.common size (GPU: chat_large)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 for *_large, else float32")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--log", type=Path, default=Path("bench/out/late_compiles_server.log"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.size.endswith("large") else "float32")
    args.log.parent.mkdir(parents=True, exist_ok=True)
    result = measure(install(args.family, args.size, dtype, args.cache_dir), args.clients, args.log)
    if args.json:
        print(json.dumps(result))
        return
    for name, level in result["levels"].items():
        print(f"{name}: {level['completion_tok_s']:.0f} tok/s in {level['wall_s']:.2f} s")
    print("phase ends (s after start):", result["phase_ends_s"])
    print(f"{len(result['late'])} kernel file(s) written after the warm-up")
    for row in result["late"]:
        print(f"  {row['s']:8.2f} s  {row['phase']:<14} {row['file'][:120]}")


if __name__ == "__main__":
    main()
