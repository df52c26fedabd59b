"""Forward speed against mlx-lm: prefill and decode tokens per second, same install.

Both engines load the same install directory (it is a valid Hugging Face
checkpoint, so ``mlx_lm.utils.load_model`` reads it unchanged) and run the
same loop: prefill the prompt in chunks of the same size, then greedy-decode
one token at a time, reading each token id back (``.item()``) before feeding
it. That loop is what a forward costs with nothing hidden by pipelining.

Each library's own generation loop is timed too (``mlx_lm.generate.generate_step``
against :func:`turbospark.generation.generate.stream_generate`): both overlap the next
forward with the host work of the current token via ``mx.async_eval``.

With *uncompiled*, our two loops run again with ``mx.disable_compile()`` (the
decode step's plain expressions: the "before" of the compiled step), and
with *cost* each engine's decode is put against the bandwidth roofline and
its step's graph size and host time are measured (:mod:`bench.decode_cost`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from bench.common import interleaved, median_of, random_tokens
from bench.decode_cost import compile_off, copy_bandwidth, decode_cost, weights_read_per_token
from turbospark.generation.generate import GenerationConfig, stream_generate
from turbospark.generation.runner import Runner
from turbospark.text import load_text

Sample = dict[str, Any]  # times in seconds; the library loops add lists


def _ours_loop(runner: Runner, prompt: list[int], decode: int, chunk: int) -> Callable[[], Sample]:
    def run() -> Sample:
        runner.reset()
        n = len(prompt)
        start = time.perf_counter()
        for begin in range(0, n, chunk):
            end = min(begin + chunk, n)
            logits = runner.prefill_chunk(prompt[begin:end], begin, logits=end == n)
        token = int(mx.argmax(logits).item())
        prefilled = time.perf_counter()
        for i in range(decode):
            token = int(mx.argmax(runner.produce(token, n + i)).item())
        return {"prefill_s": prefilled - start, "decode_s": time.perf_counter() - prefilled}

    return run


def _theirs_loop(
    model: nn.Module, prompt: list[int], decode: int, chunk: int
) -> Callable[[], Sample]:
    def run() -> Sample:
        cache = model.make_cache()
        n = len(prompt)
        start = time.perf_counter()
        for begin in range(0, n, chunk):
            end = min(begin + chunk, n)
            out = model(mx.array(prompt[begin:end])[None], cache=cache)  # (1, L, vocab)
            if end < n:
                mx.eval([c.state for c in cache])  # as generate_step's prefill does
        token = int(mx.argmax(out[0, -1]).item())
        prefilled = time.perf_counter()
        for _ in range(decode):
            out = model(mx.array([[token]]), cache=cache)
            token = int(mx.argmax(out[0, -1]).item())
        return {"prefill_s": prefilled - start, "decode_s": time.perf_counter() - prefilled}

    return run


def _ours_generate(
    runner: Runner, path: Path, prompt: list[int], decode: int, chunk: int
) -> Callable[[], Sample]:
    codec = load_text(path)
    config = GenerationConfig(max_tokens=decode + 1, stop_token_ids=[], chunk_size=chunk)

    def run() -> Sample:
        start = time.perf_counter()
        arrivals: list[float] = []  # each token's, from the start
        ids: list[int] = []
        for step in stream_generate(runner, codec, prompt, config):
            if step.token is not None:
                arrivals.append(time.perf_counter() - start)
                ids.append(step.token)
        return _timed(arrivals, time.perf_counter() - start, ids)

    return run


def _theirs_generate(
    model: nn.Module, prompt: list[int], decode: int, chunk: int
) -> Callable[[], Sample]:
    def run() -> Sample:
        cache = model.make_cache()
        start = time.perf_counter()
        arrivals: list[float] = []
        ids: list[int] = []
        steps = generate_step(
            mx.array(prompt),
            model,
            max_tokens=decode + 1,
            prompt_cache=cache,
            prefill_step_size=chunk,
        )
        for token, _ in steps:
            ids.append(int(token))  # the caller reads every id, as a detokeniser would
            arrivals.append(time.perf_counter() - start)
        return _timed(arrivals, time.perf_counter() - start, ids)

    return run


def _timed(arrivals: list[float], end: float, ids: list[int]) -> Sample:
    """A library loop's sample from each token's arrival (seconds from the
    start): prefill is the first token's, decode the rest of the run; the
    arrivals and ids go along for :mod:`bench.long_context` (decode steps
    one by one, the two engines' tokens side by side)."""
    return {
        "prefill_s": arrivals[0],
        "decode_s": end - arrivals[0],
        "arrivals_s": arrivals,
        "tokens": ids,
    }


def opened(
    path: Path, engine: str, prompt_tokens: int, context_length: int
) -> tuple[Any, int, list[int]]:
    """One engine on *path* in this process, for a fresh-process measurement:
    our :class:`Runner` or mlx-lm's model (its weights evaluated), MLX's
    active memory once loaded, and a random prompt of *prompt_tokens* from
    its vocabulary."""
    if engine == "ours":
        runner = Runner.open(path, context_length=context_length)
        return (
            runner,
            mx.get_active_memory(),
            random_tokens(prompt_tokens, runner.vocab_size, seed=1),
        )
    model, _ = load_model(path)
    mx.eval(model.parameters())
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    return model, mx.get_active_memory(), random_tokens(prompt_tokens, vocab, seed=1)


def _uncompiled(run: Callable[[], Sample]) -> Callable[[], Sample]:
    def wrapped() -> Sample:
        with compile_off():
            return run()

    return wrapped


def bench_forward(
    path: Path,
    *,
    prompt_tokens: int,
    decode_tokens: int,
    chunk: int,
    reps: int,
    library_loops: bool,
    uncompiled: bool = False,
    cost: bool = False,
) -> dict[str, Any]:
    """Prefill and decode tok/s of both engines on *path*, medians over *reps*
    interleaved repetitions (after one warm-up each); ratios are ours ÷ theirs."""
    runner = Runner.open(path, context_length=prompt_tokens + decode_tokens + 2)
    model, _ = load_model(path)
    prompt = random_tokens(prompt_tokens, runner.vocab_size, seed=1)
    engines = {
        "ours": _ours_loop(runner, prompt, decode_tokens, chunk),
        "mlx_lm": _theirs_loop(model, prompt, decode_tokens, chunk),
    }
    if library_loops:
        engines["ours_generate"] = _ours_generate(runner, path, prompt, decode_tokens, chunk)
        engines["mlx_lm_generate_step"] = _theirs_generate(model, prompt, decode_tokens, chunk)
    if uncompiled:
        for name in [n for n in engines if n.startswith("ours")]:
            engines[f"{name}_uncompiled"] = _uncompiled(engines[name])
    samples = interleaved(engines, reps)
    rates: dict[str, dict[str, float]] = {}
    for name, rows in samples.items():
        rates[name] = {
            "prefill_tok_s": prompt_tokens / median_of(rows, "prefill_s"),
            "decode_tok_s": decode_tokens / median_of(rows, "decode_s"),
            # every rep, for the spread (rep i of each engine ran in the same round)
            "prefill_tok_s_reps": [prompt_tokens / r["prefill_s"] for r in rows],
            "decode_tok_s_reps": [decode_tokens / r["decode_s"] for r in rows],
        }
    result: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "chunk": chunk,
        "reps": reps,
        "engines": rates,
        "prefill_ratio_vs_mlx_lm": rates["ours"]["prefill_tok_s"]
        / rates["mlx_lm"]["prefill_tok_s"],
        "decode_ratio_vs_mlx_lm": rates["ours"]["decode_tok_s"] / rates["mlx_lm"]["decode_tok_s"],
    }
    if cost:
        arch = runner.arch
        tied = (
            runner.model.model.embed_tokens if getattr(arch, "tie_word_embeddings", False) else None
        )
        weights = weights_read_per_token(runner.model, tied)
        on_gpu = mx.default_device() == mx.gpu
        bandwidth = copy_bandwidth(1024) if on_gpu else copy_bandwidth(256, reps=5, copies=1)
        roofline = bandwidth / weights
        result["roofline"] = {
            "weights_bytes_per_token": weights,
            "copy_bytes_per_s": bandwidth,
            "roofline_tok_s": roofline,
            "fraction": {name: r["decode_tok_s"] / roofline for name, r in rates.items()},
        }
        result["step_cost"] = decode_cost(runner, model, prompt)
    pairs = [("", "ours", "mlx_lm")]
    if library_loops:
        ours, theirs = rates["ours_generate"], rates["mlx_lm_generate_step"]
        result["generate_decode_ratio_vs_mlx_lm"] = ours["decode_tok_s"] / theirs["decode_tok_s"]
        result["generate_prefill_ratio_vs_mlx_lm"] = ours["prefill_tok_s"] / theirs["prefill_tok_s"]
        pairs.append(("generate_", "ours_generate", "mlx_lm_generate_step"))
    for prefix, ours_name, theirs_name in pairs:  # the ratio within each round: the spread
        for phase in ("prefill", "decode"):
            a, b = (
                rates[ours_name][f"{phase}_tok_s_reps"],
                rates[theirs_name][f"{phase}_tok_s_reps"],
            )
            result[f"{prefix}{phase}_ratio_reps"] = [x / y for x, y in zip(a, b, strict=True)]
    return result
