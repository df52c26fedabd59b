"""From launch to the first streamed token: ``turbospark serve`` against ``mlx_lm.server``.

What an operator who restarts a server waits for: each server is launched as
a subprocess on the same install with the same environment (so the same
BLAS), and a client polls ``/v1/models`` until it answers (``ready_s``, from
the launch), then sends one streamed chat completion through the openai SDK
at once; ``first_token_s`` is the launch to that request's first token
(content or a finish reason), and ``first_request_ttft_s`` the request's own
time to first token. Ours answers HTTP while it warms up; a request then
cuts the warm-up short (``Engine.warm_up``), and ``warm_s`` is when its
``/health`` stopped saying ``warming``, read after the first token.

Each repetition launches both servers one after the other (alternating which
goes first) and kills them; one untimed launch of each comes first, so the
operating system's file cache holds both libraries and the install, and the
client's own first-use costs are paid, for every timed launch alike.
``first_token_ratio`` is theirs ÷ ours over the medians (> 1: our first token
comes sooner), ``first_token_ratio_per_rep`` each repetition's.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so `bench.*` resolves.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving import MODEL, TEMPLATE_KWARGS, accepts, launched, wait_until

KINDS = ("turbospark", "mlx_lm")
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
MAX_TOKENS = 8


def first_token(base: str) -> tuple[float, float]:
    """One streamed chat completion, read to its end: when it was sent and when
    its first token came (perf_counter seconds)."""
    api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600.0)
    sent = time.perf_counter()
    first: float | None = None
    stream = api.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"chat_template_kwargs": TEMPLATE_KWARGS},
    )
    for chunk in stream:
        for choice in chunk.choices:
            if first is None and (choice.delta.content is not None or choice.finish_reason):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{base}: the stream ended without a token")
    return sent, first


def launch_once(
    kind: str, path: Path, log: Path, cache_limit: str | None = None
) -> dict[str, float]:
    """One cold launch of *kind*'s server: ready, first token, the request's TTFT."""
    started = time.perf_counter()
    with launched(kind, path, 1, log, cache_limit=cache_limit) as (proc, base):
        wait_until(kind, proc, base, log, accepts)
        ready = time.perf_counter()
        sent, first = first_token(base)
        row = {
            "ready_s": ready - started,
            "first_token_s": first - started,
            "first_request_ttft_s": first - sent,
        }
        if kind == "turbospark":
            wait_until(kind, proc, base, log, warmed)
            row["warm_s"] = time.perf_counter() - started
        return row


def warmed(kind: str, base: str) -> bool:
    return httpx.get(f"{base}/health", timeout=2.0).json().get("status") == "ok"


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        out[key] = statistics.median(values)
        out[f"{key}_spread"] = [min(values), max(values)]
    return out


def bench_startup(
    path: Path, reps: int, log_dir: Path, cache_limit: str | None = None
) -> dict[str, Any]:
    """Both servers launched *reps* times each on *path* (see the module docstring),
    each through :mod:`bench.capped` with *cache_limit* when given."""
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = {kind: log_dir / f"{path.name}-{kind}-startup.log" for kind in KINDS}
    for kind in KINDS:  # untimed: the file cache and the client's first use
        launch_once(kind, path, logs[kind], cache_limit)
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for rep in range(reps):
        for kind in KINDS if rep % 2 == 0 else KINDS[::-1]:
            runs[kind].append(launch_once(kind, path, logs[kind], cache_limit))
    result: dict[str, Any] = {
        kind: {**_summary(rows), "per_rep": rows} for kind, rows in runs.items()
    }
    ours, theirs = result["turbospark"], result["mlx_lm"]
    result["reps"] = reps
    result["mlx_cache_limit"] = cache_limit
    result["first_token_ratio"] = theirs["first_token_s"] / ours["first_token_s"]
    result["first_token_ratio_per_rep"] = [
        t["first_token_s"] / o["first_token_s"]
        for o, t in zip(runs["turbospark"], runs["mlx_lm"], strict=True)
    ]
    return result


def main() -> None:
    import argparse
    import json

    from bench.common import DEFAULT_CACHE, install

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gemma4")
    parser.add_argument("--size", default="chat")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    path = install(args.family, args.size, "float32", DEFAULT_CACHE)
    out = bench_startup(path, args.reps, Path(__file__).resolve().parent / "out" / "logs")
    print(json.dumps({k: v for k, v in out.items() if k not in KINDS}, indent=1))
    for kind in KINDS:
        print(kind, json.dumps({k: v for k, v in out[kind].items() if k != "per_rep"}))


if __name__ == "__main__":
    main()
