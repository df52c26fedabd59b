"""Small drivers shared by the runner-level tests: the `feed` shapes of the seed
scenarios (`tests/test_seed_scenarios.py`), a batched greedy decode, the
gated-DeltaNet kernel's reference (`tests/test_gdn_cuda.py`, `tests/test_gdn_kernel_path.py`),
the kernel-path tests' installs and runs both ways (`tests/test_norm_kernel_path.py`,
`tests/test_attention_kernel_path.py`), and the memory in use that sessions
are held to (`memory_in_use`)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from turbospark import MropePositions, Runner, build_synthetic_install
from turbospark.generation.drafters import ReplayDrafter
from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.layers import attention_step
from turbospark.layers.gated_delta.gates import log_decay, normalize_qk_heads
from turbospark.layers.gated_delta.rule import gated_delta_step
from turbospark.policies import DraftPolicies
from turbospark.state.components import State
from turbospark.text import load_text


def feed(runner: Runner, tokens: Sequence[int]) -> mx.array:
    """The sequential path: every token but the last through ``produce_prefill``,
    the last through ``produce`` (the seed's `feed`)."""
    last = len(tokens) - 1
    for position, token in enumerate(tokens[:-1]):
        runner.produce_prefill(token, position)
    return runner.produce(tokens[last], last)


def feed_chunked(runner: Runner, prompt: Sequence[int], reply: Sequence[int]) -> mx.array:
    """The server's path: the prompt as one chunk, then the reply token by token."""
    logits = runner.prefill_chunk(prompt, 0)
    for i, token in enumerate(reply):
        logits = runner.produce(token, len(prompt) + i)
    return logits


def serve_turn(runner: Runner, prompt: Sequence[int]) -> tuple[int, mx.array]:
    """The caller contract: reuse what matches, else reset; feed the rest from ``kept``."""
    kept = runner.try_reuse_prefix(prompt)
    if kept == 0:
        runner.reset()
        kept = runner.share_prefix(prompt)
    logits = runner.prefill_chunk(prompt[kept:], kept)
    runner.checkpoint()
    return kept, logits


def memory_in_use() -> int:
    """MLX's active memory once Python has let go of what nothing references
    and the queued work is done: what the tests that hold sessions to their
    own bytes compare with ``sum(runner.session_nbytes())``."""
    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


def text_positions(length: int) -> MropePositions:
    return MropePositions(triples=[(i, i, i) for i in range(length)], rope_delta=0, spans=[])


def open_runner(path, session_slots: int) -> Runner:
    """A runner as the server opens one: reuse on, 4096 context."""
    runner = Runner.open(path, context_length=4096, session_slots=session_slots)
    runner.set_prefix_reuse(True)
    return runner


def batched_greedy(runner: Runner, prompts: Sequence[Sequence[int]], steps: int) -> list[mx.array]:
    """Each prompt prefilled into its own session, the sessions merged, then
    *steps* batched greedy decode steps (each row fed its own argmax, the
    prompt's last token first): every step's ``(B, vocab)`` logits."""
    sessions = []
    for prompt in prompts:
        session = runner.checkout()
        runner.feed(session, list(prompt), 0)
        sessions.append(session)
    state = runner.merge_states(sessions)
    positions = [len(p) for p in prompts]
    tokens = mx.array([[p[-1]] for p in prompts], dtype=mx.int32)
    out = []
    for _ in range(steps):
        for component in state.values():
            component.prepare(1)
        logits = runner.forward_batch(tokens, positions, state)
        out.append(logits)
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
        positions = [p + 1 for p in positions]
        mx.eval(logits, tokens)
    return out


def state_arrays(state: State) -> dict[str, list[mx.array]]:
    """Every component's arrays, ``{name: component.arrays()}``, as
    :func:`assert_states_close` compares them."""
    return {n: c.arrays() for n, c in state.items()}


def chunks_and_steps(
    runner: Runner, prompt: Sequence[int]
) -> tuple[list[mx.array], dict[str, list[mx.array]]]:
    """*prompt* (at least 27 tokens) in uneven chunks (13, 13, the rest), then
    three decode steps: every forward's logits and every state array after."""
    logits = [runner.prefill_chunk(list(prompt[s : s + 13]), s) for s in (0, 13)]
    logits.append(runner.prefill_chunk(list(prompt[26:]), 26))
    logits += [runner.produce(5 + i, len(prompt) + i) for i in range(3)]
    return logits, state_arrays(runner.sessions()[0].state)


def group_forward(runner: Runner) -> tuple[mx.array, dict[str, list[mx.array]]]:
    """A prefill group: three rows holding 9, 20 and 31 tokens each take 11
    more in one batched forward (*runner* has 3 free session slots). Its
    logits and every merged state array."""
    sessions, held = [], [9, 20, 31]
    for r, n in enumerate(held):
        session = runner.checkout()
        runner.feed(session, [3 + (5 * i + r) % 80 for i in range(n)], 0)
        sessions.append(session)
    state = runner.merge_states(sessions)
    for component in state.values():
        component.prepare(11)
    tokens = mx.array([[4 + (3 * i + r) % 70 for i in range(11)] for r in range(3)])
    logits = runner.forward_batch(tokens, held, state)
    return logits, state_arrays(state)


def verify_and_cut(
    runner: Runner, prompt: Sequence[int], tokens: Sequence[int], keep: int
) -> tuple[mx.array, mx.array, dict[str, list[mx.array]]]:
    """*prompt* prefilled, then one verify pass of *tokens* cut to its first
    *keep*: the pass's logits, the next step's, and every state array after."""
    runner.prefill_chunk(list(prompt), 0)
    logits = runner.verify(None, list(tokens), len(prompt))
    runner.accept(None, len(prompt), keep)
    after = runner.produce(40, runner.position)
    return logits, after, state_arrays(runner.sessions()[0].state)


def assert_states_close(
    got: dict[str, list[mx.array]], want: dict[str, list[mx.array]], atol: float
) -> None:
    """Every component's arrays (``{name: component.arrays()}``) of two runs,
    the same count of each, equal to *atol* (absolute and relative)."""
    for name, arrays in want.items():
        for i, (a, b) in enumerate(zip(got[name], arrays, strict=True)):
            np.testing.assert_allclose(
                np.array(a), np.array(b), atol=atol, rtol=atol, err_msg=f"{name} array {i}"
            )


# (key heads, value heads, key head dim, value head dim): Dk below a warp, not a
# multiple of one, and the ~1B shapes' 128.
GDN_DIMS = [(2, 4, 16, 8), (1, 3, 40, 24), (16, 32, 128, 128)]


def gdn_inputs(
    batch: int, length: int, dims: tuple[int, int, int, int], dtype: mx.Dtype, seed: int
) -> tuple[mx.array, mx.array, mx.array, mx.array, int]:
    """Random ``(mixed, proj, rate, state, a_offset)`` for the kernel's contract."""
    hk, hv, dk, dv = dims
    rng = np.random.default_rng(seed)
    conv = 2 * hk * dk + hv * dv
    width = conv + hv * dv + 2 * hv + 3  # qkv | z | a | b, and a few columns past b
    mixed = mx.array(rng.standard_normal((batch, length, conv)), dtype=dtype)
    proj = mx.array(rng.standard_normal((batch, length, width)) * 2, dtype=dtype)
    rate = mx.array(-np.exp(rng.standard_normal(hv) * 0.5), dtype=mx.float32)
    state = mx.array(rng.standard_normal((batch, hv, dv, dk)) * 0.3, dtype=mx.float32)
    return mixed, proj, rate, state, conv + hv * dv


def gdn_reference(
    mixed: mx.array,
    proj: mx.array,
    rate: mx.array,
    state: mx.array,
    dims: tuple[int, int, int, int],
    a_offset: int,
) -> tuple[mx.array, mx.array]:
    """The gated-DeltaNet kernel's contract (:mod:`turbospark.layers.cuda.gdn`) from
    the layer's reference pieces in float32: the norm, the gates, one step a token;
    the outputs ``(B, T, Hv, Dv)`` and the state after every token."""
    hk, hv, dk, dv = dims
    batch, length, _ = mixed.shape
    mixed = mixed.astype(mx.float32)
    qk = mixed[..., : 2 * hk * dk].reshape(batch, length, 2 * hk, dk)
    q, k = normalize_qk_heads(qk)
    v = mixed[..., 2 * hk * dk :].reshape(batch, length, hv, dv)
    a = proj[..., a_offset : a_offset + hv].astype(mx.float32)
    b = proj[..., a_offset + hv : a_offset + 2 * hv].astype(mx.float32)
    g, beta = mx.exp(log_decay(rate, a)), mx.sigmoid(b)
    q, k = mx.repeat(q, hv // hk, axis=2), mx.repeat(k, hv // hk, axis=2)
    ys, states = [], []
    for t in range(length):
        y, state = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), mx.stack(states, axis=1)


def greedy_both_paths(
    install: Path, take: Callable[[bool], object], open_runner: Callable[..., Runner],
    prompt: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """Temperature 0, 20 tokens, three ways: with ``take(False)`` (the plain
    path), with ``take(True)`` (a kernel's path), and that path again with a
    drafter replaying the plain output at 50 % (its rejected drafts rewind)."""
    config = GenerationConfig(max_tokens=20, stop_token_ids=[])
    codec = load_text(install)
    take(False)
    plain = generate(open_runner(install), codec, prompt, config)
    take(True)
    taken = generate(open_runner(install), codec, prompt, config)
    drafter = ReplayDrafter([*prompt, *plain.tokens], 128, 4, 0.5, seed=3)
    drafted = generate(open_runner(install), codec, prompt, config, drafter=drafter)
    return plain.tokens, taken.tokens, drafted.tokens


def mtp_drafts_both_paths(
    install: Path, dims: dict, take: Callable[[bool], object],
    open_runner: Callable[..., Runner], prompt: Sequence[int],
) -> list[tuple[list[int], int, int]]:  # fmt: skip
    """A qwen_gdn install with *dims* and its MTP head built at *install*, then
    16 greedy tokens drafted by that head two ways (``take(False)``, then
    ``take(True)``): each way's tokens and draft statistics."""
    build_synthetic_install("qwen_gdn", install, vocab_size=128, model_id=install.name, **dims)
    config = GenerationConfig(max_tokens=16, stop_token_ids=[])
    runs = []
    for kernel in (False, True):
        take(kernel)
        runner = open_runner(install, draft=DraftPolicies.mtp(2))
        done = generate(runner, load_text(install), prompt, config)
        runs.append((done.tokens, done.stats.draft_proposed, done.stats.draft_accepted))
    return runs


def kind_install(tmp_dir: Path, family: str, dims: dict) -> Path:
    """A synthetic *family* install with *dims* and a 128-token vocabulary in
    *tmp_dir*, named for it (the kernel-path tests' module-scoped installs)."""
    build_synthetic_install(family, tmp_dir, vocab_size=128, model_id=tmp_dir.name, **dims)
    return tmp_dir


def host_made_sizes(monkeypatch: object) -> list[int]:
    """Record, from now on, the bytes of what a K/V-owning layer's traced
    step (core's :func:`~turbospark.layers.attention_step.owner_trace`, every
    family's) takes from the host each step: its RoPE offset, the rows
    attended and the row written (arguments 2, 5 and 6)."""
    sizes: list[int] = []
    real = attention_step.owner_trace

    def traced(inputs: object) -> Callable[..., object]:
        step = real(inputs)  # type: ignore[arg-type]

        def recorded(*args: mx.array) -> object:
            start, rows, row = args[2], args[5], args[6]
            sizes.extend(a.nbytes for a in (start, rows, row))
            return step(*args)

        return recorded

    monkeypatch.setattr(attention_step, "owner_trace", traced)  # type: ignore[attr-defined]
    return sizes


def engine_arrivals(
    runner: Runner,
    path: Path,
    prompts: Sequence[Sequence[int]],
    arrivals: Sequence[int],
    lengths: Sequence[int],
) -> list[list[int]]:
    """An engine's batch as a server runs it: prompt ``i`` submitted at step
    ``arrivals[i]`` for ``lengths[i]`` greedy tokens (at most 3 rows, prefill
    in chunks of 3 under a budget of 4), so rows join a running batch and
    leave it; each prompt's tokens."""
    engine = Engine(runner, load_text(path), max_batch=3, prefill_budget=4)
    done: list[list[int | None]] = [[] for _ in prompts]
    jobs = [
        Job(
            ids=list(prompt),
            config=GenerationConfig(max_tokens=n, stop_token_ids=[], chunk_size=3),
            emit=lambda item, got=got: got.append(getattr(item, "token", None)),
        )
        for prompt, n, got in zip(prompts, lengths, done, strict=True)
    ]
    for step in range(500):
        for i, at in enumerate(arrivals):
            if at == step:
                engine.submit(jobs[i])
        engine.step()
        if step > max(arrivals) and engine.active_rows == 0 and engine.queue_depth == 0:
            break
    return [[t for t in tokens if t is not None] for tokens in done]
