"""Where the server's prefill steps spend their time: shapes, then the engine's phases.

The H200's ``server_step`` (16 chat clients, ``chat_large``) spends 43 % of
its wall time (gemma4) and 60 % (qwen_gdn) in the steps that prefill, at
48 and 114 ms a step against 7.6 and 9.6 ms for a full decode step, while the
whole wave's prompt tokens are ~0.1 s of single-stream prefill. On the GPU
the runner thread's CPU time equals its wall time (CUDA's synchronisation
spins), so a thread profile cannot split host from device there. This
benchmark synchronises instead:

1. **shapes**: one batched prefill forward of ``B`` rows of ``L`` tokens on
   top of ``S0`` tokens each (``runner.forward_batch``, as a prefill group
   feeds it), timed to completion with ``mx.synchronize``, twice in a row:
   ``first_ms`` for a shape this process has not run, ``again_ms`` for the
   same shape at once after. The cases are the chat workload's (groups of 2
   and 3 rows of ~145 new tokens over 80 and 225 held), plus a 512-token
   single row and a 16-row decode step for scale. A ``first_ms`` far above
   ``again_ms`` is a per-shape cost (a plan, a graph, a compile) that a
   server, whose prefill shapes rarely repeat, pays on every group.
2. **phases**: the engine serving ``clients`` multi-turn chats (a warm-up
   turn, then ``turns`` timed turns of 145 new prompt tokens and 64 replies
   each, greedy), with each of its phases (the group's forward, the batched
   decode step, joins and leaves, admission, the first token, checkpoints)
   wrapped in ``mx.synchronize`` on both sides, so each phase's wall time
   holds its own device work. The synchronisation removes the overlap the
   engine normally has, so the phases add up to more than a normal run;
   they say where, not how long.
3. **held**: one row's prompt of ``new_tokens`` (460) fed on top of ``0``,
   ``~700`` and ``~1,400`` held tokens, to its first token's id, ours (the
   live session, as a chat turn's prefill) against mlx-lm's
   ``generate_step`` on a cache holding the same history, at a 4-layer
   (``chat``) and a 16-layer (``chat_host``) size: the attention over the
   history is the part that grows; interleaved reps, each round's ratio kept.

Run: ``uv run python bench/prefill_cost.py --family gemma4 [--size chat_host]
[--json]``; on a GPU: ``python3 -m bench.run --device gpu --only prefill_cost``
(``chat_large`` bf16).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from bench.common import interleaved, median_of, random_tokens
from turbospark.generation.engine import Engine, Job, _Batch
from turbospark.generation.generate import GenerationConfig
from turbospark.generation.runner import Runner
from turbospark.state.components import State
from turbospark.text import load_text

# (rows, new tokens a row, tokens each row holds already)
CASES = [
    (1, 512, 0),
    (3, 145, 80),
    (3, 146, 80),
    (3, 147, 80),
    (2, 145, 225),
    (3, 144, 81),
    (16, 1, 300),
]
PROMPT_TOKENS, NEW_TOKENS, REPLY_TOKENS = 80, 145, 64
HELD_NEW_TOKENS, HELD = 460, (0, 700, 1400)


@contextmanager
def held_group(runner: Runner, held: list[list[int]], length: int) -> Iterator[State]:
    """A prefill group as the engine feeds it: a checked-out session per row
    holding that row's *held* ids, merged, with room for *length* more tokens
    a row; the sessions are checked in and forgotten after (the next case
    starts from empty sessions)."""
    sessions = [runner.checkout() for _ in held]
    try:
        for session, ids in zip(sessions, held, strict=True):
            if ids:
                runner.feed(session, ids, 0)
        state = runner.merge_states(sessions)
        for component in state.values():
            component.prepare(length)
        yield state
    finally:
        for session in sessions:
            runner.checkin(session)
        runner.forget_sessions()


def timed_forward(
    runner: Runner,
    rng: np.random.Generator,
    rows: int,
    length: int,
    held: int,
    around: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> float:
    """Milliseconds for one batched forward of *rows* x *length* tokens after
    *held* tokens a row, from a synchronised start to its logits and state;
    the forward (not the held tokens' feeding) runs inside *around*()."""
    vocab = runner.vocab_size
    prompts = [[int(t) for t in rng.integers(0, vocab, held)] for _ in range(rows)]
    with held_group(runner, prompts, length) as state, around():
        ids = mx.array(rng.integers(0, vocab, (rows, length)), dtype=mx.int32)
        mx.synchronize()
        began = time.perf_counter()
        logits = runner.forward_batch(ids, [held] * rows, state, None)
        mx.eval(logits, [a for component in state.values() for a in component.arrays()])
        return 1e3 * (time.perf_counter() - began)


def shapes(
    path: Path,
    cases: list[tuple[int, int, int]] = CASES,
    seed: int = 0,
    on_open: Callable[[Runner], None] | None = None,
    probe: Callable[[], dict[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """Each case's forward (rows, new tokens, held tokens) the first time its
    shape runs, then again; *on_open* is called with the runner before any
    forward (a probe's preparation), *probe*'s readings are kept from before
    and after each first run (what a new shape changed, e.g. memory)."""
    runner = Runner.open(path, context_length=4096, session_slots=16)
    if on_open is not None:
        on_open(runner)
    rng = np.random.default_rng(seed)
    timed_forward(runner, rng, 1, 8, 0)  # the process's own first forward (its compiles)
    out = []
    for rows, length, held in cases:
        before = probe() if probe is not None else None
        first = timed_forward(runner, rng, rows, length, held)
        after = probe() if probe is not None else None
        again = timed_forward(runner, rng, rows, length, held)
        row: dict[str, Any] = {"rows": rows, "tokens": length, "held": held,
                               "first_ms": round(first, 2), "again_ms": round(again, 2)}  # fmt: skip
        if probe is not None:
            row["probe_before"], row["probe_after"] = before, after
        out.append(row)
    runner.close()
    return out


def _synchronised(spent: dict[str, list[float]], owner: type, name: str, label: str) -> Callable:
    """Wrap ``owner.name`` so each call's wall time, synchronised on both
    sides, is added to ``spent[label]``; returns the original to restore."""
    real = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        mx.synchronize()
        began = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            mx.synchronize()
            spent[label].append(time.perf_counter() - began)

    setattr(owner, name, timed)
    return real


PHASES = [
    (_Batch, "feed", "group forward"),
    (_Batch, "step", "batched decode step"),
    (_Batch, "join", "join"),
    (_Batch, "leave", "leave"),
    (Engine, "_admit", "admit"),
    (Engine, "_prefilled", "first token"),
    (Engine, "_decode_solo", "solo step"),
    (Engine, "_prefill_alone", "prefill alone"),
    (Runner, "checkpoint", "checkpoint"),
    (Runner, "merge_states", "merge states"),
]


def phases(
    path: Path,
    clients: int = 16,
    turns: int = 2,
    tokens: tuple[int, int, int] = (PROMPT_TOKENS, NEW_TOKENS, REPLY_TOKENS),
    seed: int = 0,
) -> dict[str, Any]:
    """The engine's phases over *turns* timed turns of *clients* chats; *tokens*:
    the first prompt's, each later turn's new prompt tokens, each reply's."""
    first, new, reply = tokens
    runner = Runner.open(path, context_length=4096, session_slots=clients)
    engine = Engine(runner, load_text(path), max_batch=clients, prefill_budget=512)
    rng = np.random.default_rng(seed)
    vocab = runner.vocab_size

    def turn(prompts: list[list[int]]) -> tuple[int, float]:
        done: list[int] = []
        for i, ids in enumerate(prompts):
            config = GenerationConfig(max_tokens=reply, temperature=0.0, seed=i, stop_token_ids=[])

            def emit(item: Any, i: int = i) -> None:
                if not isinstance(item, Exception) and item.finish_reason is not None:
                    done.append(i)

            engine.submit(Job(ids=list(ids), config=config, emit=emit))
        steps, began = 0, time.perf_counter()
        while len(done) < len(prompts):
            engine.step()
            steps += 1
        return steps, time.perf_counter() - began

    history = [[int(t) for t in rng.integers(0, vocab, first)] for _ in range(clients)]
    turn(history)  # warm-up turn: compiles, fills the sessions
    spent: dict[str, list[float]] = defaultdict(list)
    originals = [
        (owner, name, _synchronised(spent, owner, name, label)) for owner, name, label in PHASES
    ]
    timed = []
    try:
        for _ in range(turns):
            # Each client's reply (random ids here) and its next message, as a chat client sends.
            history = [h + [int(t) for t in rng.integers(0, vocab, reply + new)] for h in history]
            steps, wall = turn(history)
            timed.append({"steps": steps, "wall_s": round(wall, 3)})
    finally:
        for owner, name, real in originals:
            setattr(owner, name, real)
    runner.close()
    return {
        "clients": clients,
        "turns": timed,
        "phases": {
            label: {
                "calls": len(v),
                "total_ms": round(1e3 * sum(v), 1),
                "per_call_ms": round(1e3 * sum(v) / len(v), 2),
            }
            for label, v in sorted(spent.items(), key=lambda kv: -sum(kv[1]))
        },
    }


def _ours_held(runner: Runner, history: list[int], new: list[int]) -> Callable[[], float]:
    def run() -> float:
        runner.reset()
        if history:
            runner.prefill_chunk(history, 0, logits=False)
        mx.synchronize()
        began = time.perf_counter()
        int(mx.argmax(runner.prefill_chunk(new, len(history))).item())
        return time.perf_counter() - began

    return run


def _theirs_held(model: Any, history: list[int], new: list[int]) -> Callable[[], float]:
    def run() -> float:
        cache = model.make_cache()
        if history:
            model(mx.array(history)[None], cache=cache)
            mx.eval([c.state for c in cache])
        mx.synchronize()
        began = time.perf_counter()
        token, _ = next(generate_step(mx.array(new), model, max_tokens=1, prompt_cache=cache))
        int(token)
        return time.perf_counter() - began

    return run


def held(
    path: Path, new_tokens: int = HELD_NEW_TOKENS, lengths: tuple[int, ...] = HELD, reps: int = 5
) -> dict[str, Any]:
    """One prompt of *new_tokens* on top of each held length in *lengths*, to
    its first id: ours against mlx-lm's ``generate_step``, medians over
    *reps* interleaved rounds (after a warm-up each); ``ratio`` is mlx-lm's
    time ÷ ours (above 1 favours turbospark), ``ratio_reps`` each round's."""
    runner = Runner.open(path, context_length=max(lengths) + new_tokens + 2)
    model, _ = load_model(path)
    out: dict[str, Any] = {"new_tokens": new_tokens, "reps": reps, "rows": []}
    for length in lengths:
        history = random_tokens(length, runner.vocab_size, seed=2)
        new = random_tokens(new_tokens, runner.vocab_size, seed=3)
        engines = {
            "ours": _ours_held(runner, history, new),
            "mlx_lm": _theirs_held(model, history, new),
        }
        samples = interleaved({k: (lambda f=f: {"s": f()}) for k, f in engines.items()}, reps)
        ours, theirs = (median_of(samples[k], "s") for k in ("ours", "mlx_lm"))
        out["rows"].append({
            "held": length,
            "ours_ms": round(1e3 * ours, 2),
            "mlx_lm_ms": round(1e3 * theirs, 2),
            "ratio": theirs / ours,
            "ratio_reps": [
                b["s"] / a["s"] for a, b in zip(samples["ours"], samples["mlx_lm"], strict=True)
            ],
        })  # fmt: skip
    runner.close()
    return out


def bench_prefill_cost(path: Path, held_paths: dict[str, Path] | None = None) -> dict[str, Any]:
    """Shapes and phases on *path*; with *held_paths* (size -> install), the held comparison."""
    out = {"shapes": shapes(path), "phases": phases(path)}
    if held_paths:
        out["held"] = {size: held(p) for size, p in held_paths.items()}
    return out


def main() -> None:
    import argparse
    import json

    from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install, machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--size", default="chat_host")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--held-size", action="append", default=[],
                        help="sizes to run the held comparison at (bench.run: chat, chat_host)")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dtype = args.dtype or default_dtype()
    report: dict[str, Any] = {"machine": machine(), "dtype": dtype, "size": args.size}
    for family in args.family or FAMILIES:
        held_paths = {size: install(family, size, dtype, args.cache_dir) for size in args.held_size}
        result = bench_prefill_cost(install(family, args.size, dtype, args.cache_dir), held_paths)
        report[family] = result
        if args.json:
            continue
        print(
            f"# {family} {args.size} {dtype}: one batched forward, first time its shape runs / again"
        )
        for row in result["shapes"]:
            print(
                f"  B={row['rows']:>2} L={row['tokens']:>3} held {row['held']:>3}: "
                f"{row['first_ms']:8.2f} / {row['again_ms']:8.2f} ms"
            )
        turns = ", ".join(
            f"{t['steps']} steps in {t['wall_s']} s" for t in result["phases"]["turns"]
        )
        print(f"# the engine, {result['phases']['clients']} chats, synchronised phases ({turns})")
        for label, row in result["phases"]["phases"].items():
            print(
                f"  {label:20s} {row['calls']:5d} calls {row['total_ms']:9.1f} ms "
                f"({row['per_call_ms']:.2f} ms a call)"
            )
        for size, h in result.get("held", {}).items():
            print(f"# {size}: {h['new_tokens']} new tokens over a history, mlx-lm's time ÷ ours")
            for row in h["rows"]:
                spread = ", ".join(f"{r:.2f}" for r in row["ratio_reps"])
                print(
                    f"  held {row['held']:>5}: {row['ours_ms']:8.1f} vs {row['mlx_lm_ms']:8.1f} ms, "
                    f"{row['ratio']:.2f} ({spread})"
                )
    if args.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
