"""Interleaved conversations in process: the session pool against no pool.

The same :class:`~bench.workload.ChatWorkload` runs through
:func:`turbospark.generation.generate.generate` (the loop the server uses: reuse,
chunked prefill, checkpoint, decode) on a runner with ``session_slots=K`` and
on one with ``session_slots=1``, both with prefix reuse on. Without a pool,
round-robin turns find the live session holding another conversation, so
only the chat template's opening can be reused (attention) or nothing at all
(GDN); with K slots every conversation resumes where it stopped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.workload import ChatWorkload
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.text import load_text


class _Mode:
    """One runner serving the workload, and its per-turn records."""

    def __init__(self, path: Path, workload: ChatWorkload, slots: int) -> None:
        self.codec = load_text(path)
        self.slots = slots
        self.runner = Runner.open(path, context_length=8192, session_slots=slots)
        self.runner.set_prefix_reuse(True)
        # stop_token_ids=[]: every reply has exactly max_tokens tokens, so both modes decode alike.
        self.config = GenerationConfig(max_tokens=workload.max_tokens, stop_token_ids=[])
        # Warm-up on a prompt no conversation shares beyond the template, then a fresh session.
        warm = self.codec.encode_chat([{"role": "user", "content": "warm up"}])
        generate(self.runner, self.codec, warm, self.config)
        self.runner.reset()
        self.turns: list[dict[str, Any]] = []

    def serve(self, conv: int, turn: int, messages: list[dict[str, str]]) -> None:
        start = time.perf_counter()
        ids = self.codec.encode_chat(messages)
        stats = generate(self.runner, self.codec, ids, self.config).stats
        self.turns.append(
            {
                "conversation": conv,
                "turn": turn,
                "prompt_tokens": stats.prompt_tokens,
                "reused_tokens": stats.reused_tokens,
                "prefill_tokens": stats.prompt_tokens - stats.reused_tokens,
                "ttft_s": stats.prefill_seconds,
                "request_s": time.perf_counter() - start,
                "reason": stats.reuse_reason,
                "swapped": stats.swapped,
                "evicted": stats.evicted,
            }
        )

    def summary(self) -> dict[str, Any]:
        return {
            "session_slots": self.slots,
            "total_s": sum(t["request_s"] for t in self.turns),
            "prefill_tokens": sum(t["prefill_tokens"] for t in self.turns),
            "evictions": sum(t["evicted"] for t in self.turns),
            "turns": self.turns,
        }


def bench_interleaved(path: Path, workload: ChatWorkload) -> dict[str, Any]:
    """Pool (``session_slots=K``) against no pool (``session_slots=1``), same requests.

    Both runners live side by side and take each request in alternating order,
    so load from elsewhere on the machine hits both alike; ``total_s`` is the
    sum of a mode's request times.
    """
    pool = _Mode(path, workload, workload.conversations)
    no_pool = _Mode(path, workload, 1)
    for i, (conv, turn, messages) in enumerate(workload.requests()):
        for mode in (pool, no_pool) if i % 2 == 0 else (no_pool, pool):
            mode.serve(conv, turn, messages)
    p, n = pool.summary(), no_pool.summary()
    return {
        "conversations": workload.conversations,
        "turns": workload.turns,
        "pool": p,
        "no_pool": n,
        "speedup_vs_no_pool": n["total_s"] / p["total_s"],
        "prefill_tokens_saved": n["prefill_tokens"] - p["prefill_tokens"],
    }
