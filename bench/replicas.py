"""Replicas behind SGLang's model gateway: ``cache_aware`` against ``round_robin``.

    uv run python bench/replicas.py [--family gemma4] [--size chat] [--out DIR]

Two ``turbospark serve`` replicas on loopback, each with ``--session-slots``
enough for its half of the conversations, behind ``sglang-router`` (the
``sglang_router.launch_router`` of the dev group) with one policy at a time;
fresh replicas for each policy, so both start cold. The baseline is one
server with a slot for every conversation: what a single machine with enough
memory would reuse. The workload is ``ChatWorkload`` (8 conversations × 4
turns, fixed assistant text in the history), each conversation a client of
its own, all eight at once, every request streamed (see :func:`drive`).

Reported per setup: the share of prompt tokens served from cache (the
servers' own ``usage.prompt_tokens_details.cached_tokens``), TTFT at the
client (median, p95), and for each policy its cached tokens as a share of the
baseline's (target for ``cache_aware``: ≥ 0.9). The first turn of every
conversation can reuse nothing but the template's opening, on any setup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import DEFAULT_CACHE, default_dtype, install, machine
from bench.serving import _free_port, chat_request, running_server
from bench.workload import ChatWorkload

WORKLOAD = ChatWorkload(conversations=8, turns=4, user_chars=160, reply_chars=48, max_tokens=8)
POLICIES = ("cache_aware", "round_robin")
READY_TIMEOUT_S = 180.0


def router_command(port: int, workers: list[str], policy: str) -> list[str]:
    """The gateway on loopback in front of *workers* (README's command; its
    metrics listener on a free port, as its default 29000 may be taken)."""
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
        "--port", str(port), "--worker-urls", *workers, "--policy", policy,
        "--log-level", "warn", "--prometheus-port", str(_free_port()),
    ]  # fmt: skip


@contextmanager
def running_router(workers: list[str], policy: str, log: Path) -> Iterator[str]:
    """Start the gateway, wait until it routes (``/v1/models`` answers through it)."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            router_command(port, workers, policy), stdout=sink, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the gateway exited with {proc.returncode}; see {log}")
                try:
                    if httpx.get(f"{base}/v1/models", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway not ready after {READY_TIMEOUT_S}s; see {log}")
                time.sleep(0.25)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def drive(base: str, workload: ChatWorkload) -> list[dict[str, Any]]:
    """Every conversation of *workload* as its own client, all at once (8 users
    chatting), each sending its turns one after another through *base*.

    One client sending everything in turn would defeat the gateway: with
    nothing in flight, its ``cache_aware`` policy sends every prompt that
    matches no tree to the same (least loaded, first) worker — measured: 30
    of 30 requests to one replica."""
    by_conversation: dict[int, list[tuple[int, list[dict[str, str]]]]] = {}
    for conversation, turn, messages in workload.requests():
        by_conversation.setdefault(conversation, []).append((turn, messages))

    def chat(conversation: int) -> list[dict[str, Any]]:
        rows = []
        with httpx.Client(timeout=600.0) as client:
            for turn, messages in by_conversation[conversation]:
                row = chat_request(client, base, messages, workload.max_tokens)
                rows.append({"conversation": conversation, "turn": turn, **row})
        return rows

    with ThreadPoolExecutor(max_workers=len(by_conversation)) as pool:
        return [row for rows in pool.map(chat, sorted(by_conversation)) for row in rows]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    ttft = sorted(r["ttft_s"] for r in rows)
    return {
        "requests": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p95_ms": 1000 * ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))],
        "turns": rows,
    }


def bench_replicas(path: Path, workload: ChatWorkload, log_dir: Path) -> dict[str, Any]:
    """The baseline (one server, a slot per conversation), then 2 replicas behind
    the gateway under each policy."""
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with running_server("turbospark", path, workload.conversations + 1, log_dir / "one.log") as b:
        results["one_server"] = summary(drive(b, workload))
    per_replica = workload.conversations // 2 + 1
    for policy in POLICIES:
        with ExitStack() as stack:
            workers = [
                stack.enter_context(
                    running_server("turbospark", path, per_replica, log_dir / f"{policy}-{i}.log")
                )
                for i in range(2)
            ]
            gateway = stack.enter_context(
                running_router(workers, policy, log_dir / f"{policy}-router.log")
            )
            results[policy] = summary(drive(gateway, workload))
    baseline = results["one_server"]["cached_tokens"]
    for policy in POLICIES:
        kept = results[policy]["cached_tokens"] / baseline if baseline else 0.0
        results[policy]["cached_vs_one_server"] = kept
    results["slots"] = {"one_server": workload.conversations + 1, "per_replica": per_replica}
    return results


def print_summary(results: dict[str, Any]) -> None:
    print("setup          cached share  cached tokens  vs one server  TTFT p50 ms  TTFT p95 ms")
    for name in ("one_server", *POLICIES):
        r = results[name]
        versus = r.get("cached_vs_one_server", 1.0)
        print(
            f"{name:<14} {r['cached_share']:>12.3f}  {r['cached_tokens']:>13}  {versus:>13.3f}"
            f"  {r['ttft_p50_ms']:>11.1f}  {r['ttft_p95_ms']:>11.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="gemma4", choices=["gemma4", "qwen_gdn"])
    parser.add_argument("--size", default="chat")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    path = install(args.family, args.size, default_dtype(), args.cache_dir)
    results = bench_replicas(path, WORKLOAD, args.out / "replicas-logs")
    results["machine"] = machine()
    results["family"] = args.family
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"replicas_{args.family}.json"
    target.write_text(json.dumps(results, indent=2))
    print_summary(results)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
