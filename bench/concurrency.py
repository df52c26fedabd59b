"""N concurrent multi-turn chat clients: ``turbospark serve`` against ``mlx_lm.server``.

Both servers run as subprocesses on 127.0.0.1, serve the same install
directory and inherit the same environment (so the same BLAS). Both batch:
ours decodes up to ``--max-batch`` rows in one forward (continuous batching,
:mod:`turbospark.generation.engine`); mlx-lm's server batches through its
``BatchGenerator`` whenever every cache layer has ``merge`` and the request
has no ``seed`` (``--decode-concurrency``, default 32 rows, and
``--prompt-concurrency``, default 8 prompts, are left at their defaults).
Its prompt cache gets ``--prompt-cache-size 3 x slots`` entries (it stores
up to three per conversation: system, user and assistant segments), ours
``--session-slots`` = the most clients.

Each of N clients runs a T-turn chat at the same time (a barrier releases
them together); each turn resends the conversation with the previous reply
appended and asks for ``reply_tokens`` tokens at temperature 0, streamed.
The appended reply is a fixed text of about ``reply_tokens`` characters
(~tokens with the synthetic tokenizers), as in :mod:`bench.workload`, so both
servers see byte-identical prompts (checked: ``usage.prompt_tokens`` per
request, ``same_prompt_tokens``; no ratio is reported otherwise). With
``append_replies`` (``--append-replies``) each turn appends instead the reply
text as the client received it, as a real client does: the servers' prompts
then differ where their replies did, so the ratios come with
``prompt_tokens_ratio`` (all prompt tokens ours ÷ theirs: the work each was
given), and what counts beside them is ``cached_by_turn``, the prompt tokens
each server says it had cached (``usage.prompt_tokens_details.cached_tokens``)
per turn, reported in every mode.

Both must also generate the same number of tokens. Ours takes the
``ignore_eos`` extension (vLLM's name). mlx-lm's server has no such field
but honours ``logit_bias``: every id in its own ``eos_token_ids`` (as its
loader builds them) gets -1e9, so it never stops early either. Each side's
``usage.completion_tokens`` is checked against ``reply_tokens``
(``same_completion_tokens``). At temperature 0 the two then pick different
tokens only where an eos id was the argmax (ours feeds it, theirs takes the
runner-up): the work per step is the same.

Reported per engine and N: aggregate completion tok/s (all completion
tokens ÷ wall time from the barrier to the last client's last byte), TTFT
p50/p95 over every request (client side: request sent → first SSE event
carrying content or a finish reason) and wall time; ratios are ours ÷ theirs
for tok/s and for TTFT p50 (< 1: we answer sooner). Before timing, each
server answers one chat (its TTFT is ``first_request_ttft_s``: ours is sent
once ``/health`` no longer says ``warming``, so after ``serve`` ran its own
warm-up; mlx-lm's server has none; ``ready_s`` is each server's time from
spawn to ready, and ``warm_up`` our server's log line timing its warm-up's
rounds) and one burst of the
most clients with a few tokens each, so kernels for the batched shapes exist.
Levels run in order; each level runs ``reps`` times on fresh conversations
(a new seed each), alternating which server goes first, and reports the
median over repetitions of each number (``per_rep`` keeps them all,
``tok_s_ratio_per_rep`` the ratio of each repetition).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so `bench.*` resolves.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving import chat_request, running_server, warm_up_line
from bench.workload import ChatWorkload
from turbospark.commands import byte_size

KINDS = ("turbospark", "mlx_lm")
WARM_UP_TOKENS = 8


@dataclass(frozen=True)
class ConcurrencyPlan:
    clients: tuple[int, ...] = (1, 8, 16)
    turns: int = 3
    reply_tokens: int = 64
    user_chars: int = 64
    reps: int = 1  # per level, fresh chats each, alternating which server goes first
    seed: int = 100
    # Each turn appends the previous reply as the client received it, not the
    # workload's fixed text: how a real client continues, so the cached tokens
    # per turn show whether each server reuses through its own re-sent replies.
    append_replies: bool = False


def conversations(n: int, plan: ConcurrencyPlan, seed: int) -> list[list[list[dict[str, str]]]]:
    """Per client, the messages of each turn (the previous replies appended)."""
    chat = ChatWorkload(
        conversations=n,
        turns=plan.turns,
        user_chars=plan.user_chars,
        reply_chars=plan.reply_tokens,
        max_tokens=plan.reply_tokens,
        seed=seed,
    )
    out: list[list[list[dict[str, str]]]] = [[] for _ in range(n)]
    for conv, _turn, messages in chat.requests():
        out[conv].append(messages)
    return out


def mlx_lm_eos_ids(path: Path) -> list[int]:
    """The ids mlx-lm's server stops on, built as its loader builds them."""
    from mlx_lm.utils import load_config, load_tokenizer

    config = load_config(path)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return sorted(int(i) for i in tokenizer.eos_token_ids)


def run_clients(
    base: str,
    chats: list[list[list[dict[str, str]]]],
    max_tokens: int,
    extra: dict[str, Any],
    append_replies: bool = False,
) -> dict[str, Any]:
    """All clients at once, each turn after its previous reply ended; with
    *append_replies*, each turn carries the replies this server sent (the
    user messages stay the chats')."""
    rows: list[list[dict[str, Any]]] = [[] for _ in chats]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(chats) + 1)

    def client(index: int) -> None:
        try:
            with httpx.Client(timeout=600.0) as http:
                barrier.wait()
                sent: list[dict[str, str]] = []
                reply = ""
                for turn, messages in enumerate(chats[index]):
                    if append_replies and turn:
                        messages = [*sent, {"role": "assistant", "content": reply}, messages[-1]]
                    row = request_with_retries(http, base, messages, max_tokens, extra)
                    sent, reply = messages, row.pop("text")
                    rows[index].append({"client": index, "turn": turn, **row})
        except BaseException as exc:  # reported below, after every thread ended
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(chats))]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed, first: {errors[0]!r}") from errors[0]
    flat = [row for client_rows in rows for row in client_rows]
    ttfts = sorted(row["ttft_s"] for row in flat)
    completion = sum(row["completion_tokens"] for row in flat)
    return {
        "wall_s": wall,
        "retries": sum(row["retries"] for row in flat),
        "completion_tokens": completion,
        "completion_tok_s": completion / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": percentile(ttfts, 95),
        "requests": flat,
    }


def request_with_retries(
    http: httpx.Client,
    base: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    extra: dict[str, Any],
    attempts: int = 5,
) -> dict[str, Any]:
    """:func:`chat_request`, sent again when the connection is refused or reset.

    mlx_lm.server is a ``ThreadingHTTPServer``: HTTP/1.0 (a new connection per
    request) and Python's default listen backlog of 5, so 16 clients connecting
    at once on a loaded machine can find a connection reset before any reply.
    The client then tries again; the time lost counts in its TTFT and request
    time, and ``retries`` says how often it happened."""
    started = time.perf_counter()
    for attempt in range(attempts):
        try:
            row = chat_request(http, base, messages, max_tokens, extra)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
            continue
        lost = time.perf_counter() - started - row["request_s"]
        return {
            **row,
            "ttft_s": row["ttft_s"] + lost,
            "request_s": row["request_s"] + lost,
            "retries": attempt,
        }
    raise AssertionError("unreachable")


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def compare(
    level: dict[str, Any], reply_tokens: int, append_replies: bool = False
) -> dict[str, Any]:
    """Ratios ours ÷ theirs, only when both made the same tokens and saw the
    same prompts; with *append_replies* the prompts carry each server's own
    replies, so they may differ, and ``prompt_tokens_ratio`` says by how much."""
    ours, theirs = level["turbospark"]["requests"], level["mlx_lm"]["requests"]
    key = lambda row: (row.get("rep", 0), row["client"], row["turn"])  # noqa: E731
    ours, theirs = sorted(ours, key=key), sorted(theirs, key=key)
    mismatched = [
        (o["client"], o["turn"], o["prompt_tokens"], t["prompt_tokens"])
        for o, t in zip(ours, theirs, strict=True)
        if o["prompt_tokens"] != t["prompt_tokens"]
    ]
    short = [
        (kind, row["client"], row["turn"], row["completion_tokens"])
        for kind in KINDS
        for row in level[kind]["requests"]
        if row["completion_tokens"] != reply_tokens
    ]
    out: dict[str, Any] = {
        "same_prompt_tokens": not mismatched,
        "same_completion_tokens": not short,
    }
    if append_replies:
        totals = [sum(row["prompt_tokens"] for row in rows) for rows in (ours, theirs)]
        out["prompt_tokens_ratio"] = totals[0] / totals[1]
    if mismatched and not append_replies:
        client, turn, a, b = mismatched[0]
        out["ratio_refused"] = (
            f"prompt tokens differ on {len(mismatched)} request(s), first client {client} "
            f"turn {turn}: {a} (turbospark) vs {b} (mlx-lm)"
        )
        return out
    if short:
        kind, client, turn, n = short[0]
        out["ratio_refused"] = (
            f"{len(short)} request(s) did not generate {reply_tokens} tokens, first {kind} "
            f"client {client} turn {turn}: {n}"
        )
        return out
    a, b = level["turbospark"], level["mlx_lm"]
    out["tok_s_ratio"] = a["completion_tok_s"] / b["completion_tok_s"]
    out["ttft_p50_ratio"] = a["ttft_p50_s"] / b["ttft_p50_s"]
    out["ttft_p95_ratio"] = a["ttft_p95_s"] / b["ttft_p95_s"]
    out["wall_ratio"] = a["wall_s"] / b["wall_s"]
    return out


def bench_concurrency(
    path: Path,
    plan: ConcurrencyPlan,
    log_dir: Path,
    max_batch: int | None = None,
    serve_args: Sequence[str] = (),
    cache_limit: str | None = None,
) -> dict[str, Any]:
    """Every level of ``plan.clients`` against both servers, started once for
    all levels; *serve_args* go to ``turbospark serve`` after the bench's own;
    *cache_limit* (a size) bounds both servers' MLX buffer cache
    (:mod:`bench.capped`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    most = max(plan.clients)
    max_batch = max_batch or most
    extra_args = {
        "turbospark": ["--max-batch", str(max_batch), *serve_args],
        "mlx_lm": ["--prompt-cache-size", str(3 * most)],
    }
    eos = mlx_lm_eos_ids(path)
    bodies: dict[str, dict[str, Any]] = {
        "turbospark": {"ignore_eos": True},
        "mlx_lm": {"logit_bias": {str(i): -1e9 for i in eos}},
    }
    result: dict[str, Any] = {
        "settings": {
            "clients": list(plan.clients),
            "turns": plan.turns,
            "reply_tokens": plan.reply_tokens,
            "user_chars": plan.user_chars,
            "reps": plan.reps,
            "append_replies": plan.append_replies,
            "turbospark_args": extra_args["turbospark"] + ["--session-slots", str(most)],
            "mlx_lm_args": extra_args["mlx_lm"],
            "mlx_lm_eos_ids_biased": eos,
            "mlx_cache_limit": cache_limit,
        },
        "levels": {},
    }
    with ExitStack() as stack:
        bases: dict[str, str] = {}
        ready: dict[str, float] = {}
        for kind in KINDS:  # one at a time, so each start-up is timed alone
            started = time.perf_counter()
            bases[kind] = stack.enter_context(
                running_server(
                    kind, path, most, log_dir / f"{path.name}-{kind}-concurrency.log",
                    extra_args[kind], cache_limit,
                )
            )  # fmt: skip
            ready[kind] = time.perf_counter() - started
        result["ready_s"] = ready
        result["warm_up"] = warm_up_line(log_dir / f"{path.name}-turbospark-concurrency.log")
        # The first request each server answers after start (ours warmed itself
        # up before accepting it), then a burst at the widest batch.
        first: dict[str, float] = {}
        warm = conversations(most, plan, plan.seed - 1)
        with httpx.Client(timeout=600.0) as http:
            for kind in KINDS:
                row = chat_request(http, bases[kind], warm[0][0], WARM_UP_TOKENS, bodies[kind])
                first[kind] = row["ttft_s"]
        for kind in KINDS:
            run_clients(bases[kind], [c[:1] for c in warm], WARM_UP_TOKENS, bodies[kind])
        with httpx.Client(timeout=600.0) as http:  # after warm-up: one request alone
            for kind in KINDS:
                row = chat_request(http, bases[kind], warm[0][1], WARM_UP_TOKENS, bodies[kind])
                first[f"{kind}_after_burst"] = row["ttft_s"]
        result["first_request_ttft_s"] = first
        for i, n in enumerate(plan.clients):
            runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
            for rep in range(plan.reps):
                chats = conversations(n, plan, plan.seed + 100 * i + rep)
                for kind in KINDS if (i + rep) % 2 == 0 else KINDS[::-1]:
                    run = run_clients(
                        bases[kind], chats, plan.reply_tokens, bodies[kind], plan.append_replies
                    )
                    for row in run["requests"]:
                        row["rep"] = rep
                    runs[kind].append(run)
            level: dict[str, Any] = {kind: medians(runs[kind]) for kind in KINDS}
            for kind in KINDS:
                level[kind]["cached_by_turn"] = cached_by_turn(level[kind]["requests"])
            level.update(compare(level, plan.reply_tokens, plan.append_replies))
            if "tok_s_ratio" in level:
                level["tok_s_ratio_per_rep"] = [
                    a["completion_tok_s"] / b["completion_tok_s"]
                    for a, b in zip(runs["turbospark"], runs["mlx_lm"], strict=True)
                ]
            result["levels"][str(n)] = level
    return result


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key the median over repetitions; every request kept (with its ``rep``)."""
    keys = ("wall_s", "completion_tokens", "completion_tok_s", "ttft_p50_s", "ttft_p95_s")
    out: dict[str, Any] = {key: statistics.median(run[key] for run in runs) for key in keys}
    out["retries"] = sum(run["retries"] for run in runs)
    out["per_rep"] = [{key: run[key] for key in keys} for run in runs]
    out["requests"] = [row for run in runs for row in run["requests"]]
    return out


def cached_by_turn(requests: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Per turn, over every client and repetition: prompt tokens sent and those
    the server said it had cached (``usage.prompt_tokens_details.cached_tokens``,
    which mlx_lm.server reports too)."""
    turns = sorted({row["turn"] for row in requests})
    return [
        {
            "turn": turn,
            "prompt_tokens": sum(r["prompt_tokens"] for r in requests if r["turn"] == turn),
            "cached_tokens": sum(r["cached_tokens"] for r in requests if r["turn"] == turn),
        }
        for turn in turns
    ]


def summary(result: dict[str, Any]) -> list[str]:
    """One line per level: ours, theirs, ratios."""
    lines = []
    for n, level in result["levels"].items():
        a, b = level["turbospark"], level["mlx_lm"]
        ratio = (
            f"tok/s x{level['tok_s_ratio']:.2f}, TTFT p50 ours/theirs {level['ttft_p50_ratio']:.2f}"
            + (
                f", prompt tokens ours/theirs {level['prompt_tokens_ratio']:.2f}"
                if "prompt_tokens_ratio" in level
                else ""
            )
            if "tok_s_ratio" in level
            else f"no ratio: {level['ratio_refused']}"
        )
        lines.append(
            f"N={n:>2}  ours {a['completion_tok_s']:7.1f} tok/s  TTFT p50 {a['ttft_p50_s'] * 1e3:7.1f}"
            f" p95 {a['ttft_p95_s'] * 1e3:7.1f} ms  wall {a['wall_s']:6.2f} s | mlx_lm.server "
            f"{b['completion_tok_s']:7.1f} tok/s  TTFT p50 {b['ttft_p50_s'] * 1e3:7.1f} p95 "
            f"{b['ttft_p95_s'] * 1e3:7.1f} ms  wall {b['wall_s']:6.2f} s | {ratio}"
            + (f" | retries {b['retries']}" if b.get("retries") else "")
        )
        cached = {
            kind: " ".join(
                f"{t['cached_tokens']}/{t['prompt_tokens']}" for t in level[kind]["cached_by_turn"]
            )
            for kind in KINDS
        }
        lines.append(
            f"       cached/prompt tokens per turn: ours {cached['turbospark']} | "
            f"mlx_lm.server {cached['mlx_lm']}"
        )
    return lines


def _size_text(text: str) -> str:
    """*text* as given (the servers read it), once it reads as a size: a
    bad one is refused here, not by each server as it starts."""
    byte_size(text)
    return text


def main() -> None:
    import argparse
    import json

    from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install, machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--size", default="chat")
    parser.add_argument("--clients", type=int, action="append", help="repeatable; default 1 8 16")
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--reps", type=int, default=1, help="per level; medians reported")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--append-replies",
        action="store_true",
        help="each turn appends the reply as received (default: a fixed text)",
    )
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="passed to turbospark serve; repeatable"
    )
    parser.add_argument(
        "--cache-limit",
        type=_size_text,
        metavar="SIZE",
        help="bound both servers' MLX buffer cache (e.g. 8GiB, through bench.capped; "
        "default: MLX's own)",
    )
    args = parser.parse_args()
    plan = ConcurrencyPlan(
        clients=tuple(args.clients or (1, 8, 16)),
        turns=args.turns,
        reply_tokens=args.reply_tokens,
        reps=args.reps,
        append_replies=args.append_replies,
    )
    dtype = args.dtype or default_dtype()
    report: dict[str, Any] = {"machine": machine(), "dtype": dtype, "size": args.size}
    started = time.perf_counter()
    for family in args.family or FAMILIES:
        path = install(family, args.size, dtype, args.cache_dir)
        report[family] = bench_concurrency(
            path, plan, args.out / "logs", serve_args=args.serve_arg, cache_limit=args.cache_limit
        )
        if not args.json:
            print(f"== {family} ({args.size}, {dtype})", *summary(report[family]), sep="\n")
    report["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "concurrency.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        json.dump(report, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
