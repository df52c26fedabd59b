"""``DraftPolicies.mtp``: Qwen3.5's multi-token-prediction head as the drafter.

The head's math against an independent NumPy reading of the reference formula,
refusals by name, greedy output identical to ``off`` (generation loop, engine,
server), an MTP K/V that never keeps an unverified token, sampled speculation
unbiased with the head's own q, and the stats in ``generate --json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from helpers import memory_in_use
from turbospark.errors import InvalidInput
from turbospark.generation.drafters import Draft
from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.mtp import MtpDrafter
from turbospark.generation.runner import Runner
from turbospark.generation.sampling import Sampler, SamplingParams
from turbospark.generation.speculation import accept_sampled
from turbospark.loading.install import load_weights, read_manifest
from turbospark.policies import DraftPolicies
from turbospark.text import load_text

PROMPT = [*range(3, 30), *range(3, 15)]
CONFIG = GenerationConfig(max_tokens=24, stop_token_ids=[])


def open_runner(path: Path, **kwargs: Any) -> Runner:
    return Runner.open(path, context_length=256, dtype="float32", **kwargs)


# -- the head's math -------------------------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Qwen3.5's RMSNorm: weights stored zero-centred, applied as ``1 + w``."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x: np.ndarray, positions: np.ndarray, dims: int, base: float) -> np.ndarray:
    """Partial RoPE, non-traditional halves, on the first *dims* of each head. x: (L, heads, d)."""
    half = dims // 2
    angles = positions[:, None] * base ** (-np.arange(0, dims, 2) / dims)  # (L, half)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., dims:]], -1)


def reference_mtp(w: dict[str, np.ndarray], arch: Any, tokens, hidden, start: int) -> np.ndarray:
    """Logits ``(L, vocab)`` of the MTP head over ``tokens``/``hidden`` at ``start ..``,
    straight from the checkpoint's tensors (HF layout), in float64."""
    root, m = "model.language_model", "mtp"
    heads, kv_heads, dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    e = _rms(w[f"{root}.embed_tokens.weight"][tokens], w[f"{m}.pre_fc_norm_embedding.weight"])
    h = _rms(hidden, w[f"{m}.pre_fc_norm_hidden.weight"])
    x = np.concatenate([e, h], -1) @ w[f"{m}.fc.weight"].T  # embedding first, then hidden
    p = f"{m}.layers.0"
    y = _rms(x, w[f"{p}.input_layernorm.weight"])
    length = len(tokens)
    qg = (y @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(length, heads, 2 * dim)
    q, gate = qg[..., :dim], qg[..., dim:]
    k = (y @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(length, kv_heads, dim)
    v = (y @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(length, kv_heads, dim)
    q = _rms(q, w[f"{p}.self_attn.q_norm.weight"])
    k = _rms(k, w[f"{p}.self_attn.k_norm.weight"])
    positions = np.arange(start, start + length, dtype=np.float64)
    rope = arch.rope_parameters
    q = _rope(q, positions, arch.rotary_dims, rope.rope_theta)
    k = _rope(k, positions, arch.rotary_dims, rope.rope_theta)
    group = heads // kv_heads
    out = np.zeros((length, heads, dim))
    causal = np.tril(np.ones((length, length), bool))
    for head in range(heads):
        scores = q[:, head] @ k[:, head // group].T * dim**-0.5
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[:, head] = probs @ v[:, head // group]
    gated = out.reshape(length, -1) / (1.0 + np.exp(-gate.reshape(length, -1)))
    x = x + gated @ w[f"{p}.self_attn.o_proj.weight"].T
    y = _rms(x, w[f"{p}.post_attention_layernorm.weight"])
    g, u = y @ w[f"{p}.mlp.gate_proj.weight"].T, y @ w[f"{p}.mlp.up_proj.weight"].T
    x = x + (g / (1.0 + np.exp(-g)) * u) @ w[f"{p}.mlp.down_proj.weight"].T
    return _rms(x, w[f"{m}.norm.weight"]) @ w["lm_head.weight"].T, _rms(x, w[f"{m}.norm.weight"])


@pytest.mark.parametrize("start", [0, 5])
def test_the_mtp_head_computes_the_reference_formula(mtp_install, start):
    """Five entries, then one step on the head's own output (depth 2), against
    the formula over the six at once: norms, concat order, gated attention,
    RoPE by position (also from a cache that starts past 0), MLP, shared head."""
    runner = open_runner(mtp_install, draft=DraftPolicies.mtp())
    head = runner.mtp_head
    raw = {k: np.array(v, dtype=np.float64) for k, v in load_weights(
        mtp_install, read_manifest(mtp_install)).items()}  # fmt: skip
    rng = np.random.default_rng(0)
    tokens = [7, 19, 3, 88, 41]
    hidden = rng.normal(size=(5, runner.arch.hidden_size))
    cache = head.new_cache(start)
    out = head.step(mx.array(tokens), mx.array(hidden, dtype=mx.float32), cache)
    got = head.logits(out)
    deeper = head.step(mx.array([60]), out[-1:], cache)
    assert cache.position == start + 6
    expected, normed = reference_mtp(raw, runner.arch, tokens, hidden, start)
    np.testing.assert_allclose(np.array(got), expected, atol=2e-4, rtol=2e-4)
    own = np.concatenate([hidden, np.array(out[-1:], dtype=np.float64)])
    expected_deeper, _ = reference_mtp(raw, runner.arch, [*tokens, 60], own, start)
    np.testing.assert_allclose(np.array(head.logits(deeper)), expected_deeper[-1:], atol=2e-4)
    np.testing.assert_allclose(np.array(out), normed, atol=2e-5)


# -- refusals --------------------------------------------------------------------------


def test_mtp_is_refused_by_name_without_weights_or_without_a_head(qwen_gdn_install, gemma4_install):
    with pytest.raises(InvalidInput, match=r"carries no mtp\.\* weights"):
        open_runner(qwen_gdn_install, draft=DraftPolicies.mtp())
    with pytest.raises(InvalidInput, match="family 'gemma4' has no multi-token-prediction head"):
        open_runner(gemma4_install, draft=DraftPolicies.mtp())
    with pytest.raises(InvalidInput, match="depth=0"):
        DraftPolicies.mtp(depth=0)


# -- greedy: identical to off -----------------------------------------------------------


def off_completion(path: Path, config: GenerationConfig = CONFIG):
    return generate(open_runner(path), load_text(path), PROMPT, config)


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_output_with_mtp_equals_off(mtp_install, depth):
    off = off_completion(mtp_install)
    runner = open_runner(mtp_install, draft=DraftPolicies.mtp(depth))
    drafted = generate(runner, load_text(mtp_install), PROMPT, CONFIG)
    assert (drafted.tokens, drafted.finish_reason) == (off.tokens, off.finish_reason)
    assert drafted.stats.draft_proposed > 0
    session = runner.sessions()[0]
    assert session.record.tokens == [*PROMPT, *off.tokens[:-1]]
    track = session.mtp
    assert track.cache.position <= session.position - 1  # entry j read token j + 1: fed
    assert track.hidden_end <= session.position
    # The head's K/V and hidden states count in the session's bytes (the pool's budget).
    # Its arrays are its own (derived from the state, never shared with it).
    session.mtp = None
    state_bytes = session.nbytes
    session.mtp = track
    assert track.nbytes > 0 and session.nbytes == state_bytes + track.nbytes


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_parked_mtp_session_holds_only_the_hidden_states_it_counts(mtp_install, max_tokens):
    """The track keeps the prompt's hidden states for the head to read. Left
    lazy, each prefill chunk's kept its forward's last layer alive (a reply
    of one token parks before any draft reads them: about four times the
    session); once read, the row kept after the draft was a slice of the
    joined prompt, keeping every row of it. Parked, the session's bytes are
    what it holds."""
    runner = Runner.open(
        mtp_install,
        context_length=2048,
        dtype="float32",
        session_slots=2,
        draft=DraftPolicies.mtp(4),
    )
    codec = load_text(mtp_install)
    config = GenerationConfig(
        max_tokens=max_tokens, temperature=0.0, stop_token_ids=[], chunk_size=128
    )

    def park(k: int) -> None:
        generate(runner, codec, [2, *((7 * i + k) % 100 + 10 for i in range(1200))], config)
        runner.reset()

    park(0)  # the first builds what the process keeps (compiled steps, caches)
    runner.forget_sessions()
    before = memory_in_use()
    park(1)
    held = sum(runner.session_nbytes())
    assert any(s.mtp is not None and s.mtp.hidden for s in runner.sessions())
    assert memory_in_use() - before <= held + held // 5


def test_after_a_miss_mtp_probes_in_the_shadow_and_rarely_and_output_equals_off(
    mtp_install, monkeypatch
):
    """The head's first round misses (random weights); from then on it drafts from
    the still-lazy id beside plain steps (MtpDrafter.probe_after) and its guess is
    compared with the step's token (a shadow probe: every forward after that round
    feeds one token), depth 1, with pauses that grow 4x (a probe runs the head):
    three probes in 48 tokens, the reply and the session are off's, and neither
    the head's K/V nor its hidden states run past the session."""
    config = CONFIG.model_copy(update={"max_tokens": 48})
    off = off_completion(mtp_install, config)
    runner = open_runner(mtp_install, draft=DraftPolicies.mtp(4))
    lengths: list[int] = []
    feed = Runner._feed

    def counting_feed(self, tokens, start, *args, **kwargs):
        if start >= len(PROMPT):
            lengths.append(len(tokens))
        return feed(self, tokens, start, *args, **kwargs)

    monkeypatch.setattr(Runner, "_feed", counting_feed)
    done = generate(runner, load_text(mtp_install), PROMPT, config)
    assert done.tokens == off.tokens
    assert done.stats.draft_accepted == 0 and done.stats.draft_proposed == 1  # the first round
    assert lengths[0] == 2 and set(lengths[1:]) == {1}  # that round's pass, then plain steps
    assert done.stats.draft_probed == 3  # pauses of 1, 4, 16 after the first round
    session = runner.sessions()[0]
    assert session.record.tokens == [*PROMPT, *off.tokens[:-1]]
    assert session.mtp.cache.position <= session.position - 1
    assert session.mtp.hidden_end <= session.position


@pytest.mark.parametrize("stop_at", [2, 3, 7, 8])
def test_an_mtp_probe_whose_unread_id_is_a_stop_leaves_nothing_fed(mtp_install, stop_at):
    """A shadow MTP probe drafts from the unread id beside the step that feeds it;
    when that id is a stop (the probes draft from ids 2 and 8 here; 3 and 7 are
    plain steps), the reply ends where off's does and neither the session nor the
    head's K/V keeps it."""
    off = off_completion(mtp_install)
    config = CONFIG.model_copy(update={"stop_token_ids": [off.tokens[stop_at]]})
    plain = off_completion(mtp_install, config)
    runner = open_runner(mtp_install, draft=DraftPolicies.mtp(4))
    done = generate(runner, load_text(mtp_install), PROMPT, config)
    assert (done.tokens, done.finish_reason) == (plain.tokens, plain.finish_reason)
    session = runner.sessions()[0]
    assert session.record.tokens == [*PROMPT, *plain.tokens]
    assert session.mtp.cache.position <= session.position - 1
    assert session.mtp.hidden_end <= session.position


class _MtpThenOracle:
    """Asks the MTP drafter every round (its cache catches up, steps on its own
    drafts and rewinds), then proposes the recorded greedy run with the last
    token wrong from depth 3 on: rounds of depth 4 keep 3 drafts, so the head's
    own speculative entries would survive a missed rewind."""

    def __init__(self, mtp: MtpDrafter, reference: list[int]) -> None:
        self.mtp, self.reference, self.max_depth = mtp, reference, 4
        self.guesses_ahead = False  # every round and probe asks the MTP drafter

    def propose_ahead(self, context, depth):
        return Draft([])

    def propose(self, context, depth):
        self.mtp.propose(context, depth)
        truth = self.reference[len(context) : len(context) + depth]
        if len(truth) >= 3:
            truth[-1] = (truth[-1] + 1) % 128
        return Draft(truth)


def test_after_accepted_and_rejected_rounds_the_mtp_cache_equals_a_fresh_catch_up(mtp_install):
    """The MTP K/V a drafted reply leaves equals one built over the same tokens in
    one go: no rejected token, nor any of the head's own speculative steps, stays."""
    off = off_completion(mtp_install)
    runner = open_runner(mtp_install, draft=DraftPolicies.mtp(4))
    greedy = Sampler(SamplingParams())
    mtp = MtpDrafter(runner.mtp_head, lambda: runner.mtp_track(None), greedy, 4)
    drafter = _MtpThenOracle(mtp, [*PROMPT, *off.tokens])
    done = generate(runner, load_text(mtp_install), PROMPT, CONFIG, drafter=drafter)
    assert done.tokens == off.tokens
    assert 0 < done.stats.draft_accepted < done.stats.draft_proposed
    context = [*PROMPT, *off.tokens]  # everything fed, then the last (confirmed) token

    fresh = open_runner(mtp_install, draft=DraftPolicies.mtp(4))
    fresh.prefill_chunk(context[:-1], 0)
    # Both propose at temperature 1 from a fresh sampler with one seed: equal q's
    # mean equal caches (the first row depends on every entry).
    drafts = []
    for r in (runner, fresh):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=4))
        drafts.append(MtpDrafter(r.mtp_head, lambda r=r: r.mtp_track(None), sampler, 3))
    a = drafts[0].propose(context, 3)
    b = drafts[1].propose(context, 3)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(np.array(a.probs), np.array(b.probs), atol=1e-5)
    # The next step's logits equal a fresh run too (the main model's state).
    after = runner.produce(context[-1], runner.position)
    expected = fresh.produce(context[-1], fresh.position)
    np.testing.assert_allclose(np.array(after), np.array(expected), atol=1e-5, rtol=1e-5)


def test_an_engine_row_drafting_with_mtp_equals_off(mtp_install):
    off = off_completion(mtp_install)
    runner = open_runner(mtp_install, draft=DraftPolicies.mtp(2))
    engine = Engine(runner, load_text(mtp_install))
    chunks: list = []
    engine.submit(Job(ids=list(PROMPT), config=CONFIG, emit=chunks.append))
    for _ in range(200):
        if chunks and chunks[-1].finish_reason is not None:
            break
        engine.step()
    assert [c.token for c in chunks if c.token is not None] == off.tokens
    assert chunks[-1].stats.draft_proposed > 0


def test_engine_rows_decoding_in_a_batch_under_mtp_equal_off(mtp_install):
    """Two rows decode batched (the batched forward hands back no hidden state
    and batched rows do not draft): both replies are off's."""
    short = CONFIG.model_copy(update={"max_tokens": 4})
    prompts = [(PROMPT, CONFIG), ([*PROMPT[:20], 99], short)]
    expected = [
        generate(open_runner(mtp_install), load_text(mtp_install), ids, config).tokens
        for ids, config in prompts
    ]
    runner = open_runner(mtp_install, draft=DraftPolicies.mtp(2), session_slots=3)
    engine = Engine(runner, load_text(mtp_install))
    outputs: list[list] = [[], []]
    for (ids, config), out in zip(prompts, outputs, strict=True):
        engine.submit(Job(ids=list(ids), config=config, emit=out.append))
    for _ in range(300):
        if all(out and out[-1].finish_reason is not None for out in outputs):
            break
        engine.step()
    assert [[c.token for c in out if c.token is not None] for out in outputs] == expected


def test_a_second_turn_reusing_the_prompt_equals_off(mtp_install):
    """The second turn reuses the first's prefix (whose hidden states it never
    saw): drafting starts after that gap, the replies are off's."""
    codec = load_text(mtp_install)
    config = CONFIG.model_copy(update={"max_tokens": 10})
    outputs = []
    for draft in (DraftPolicies.off(), DraftPolicies.mtp(2)):
        runner = open_runner(mtp_install, draft=draft, session_slots=2)
        runner.set_prefix_reuse(True)
        first = generate(runner, codec, PROMPT, config)
        second = generate(runner, codec, [*PROMPT, 50, 51, 52], config)
        outputs.append((first.tokens, second.tokens, second.stats.reused_tokens))
        proposed = second.stats.draft_proposed
    assert outputs[0] == outputs[1]
    assert outputs[0][2] > 0
    assert proposed > 0


def test_the_server_drafts_with_mtp_and_reports_it(mtp_install):
    from serving import client, serving

    codec = load_text(mtp_install)
    with serving(mtp_install, codec, 1, draft=DraftPolicies.mtp(2)) as server:
        api = client(server)
        ask = {"model": "tiny-qwen-mtp", "prompt": "abc abc abc abc", "max_tokens": 24}
        body = {"ignore_eos": True}
        drafted = api.completions.create(**ask, temperature=0, extra_body=body)
        plain = api.completions.create(**ask, temperature=0, extra_body={**body, "draft": "off"})
        assert drafted.choices[0].text == plain.choices[0].text
        usage = drafted.usage.turbospark
        assert usage["draft_proposed"] > 0
        assert usage["draft_proposed"] >= usage["draft_accepted"] >= 0
        assert plain.usage.turbospark["draft_proposed"] == 0


# -- sampling stays unbiased ---------------------------------------------------------------


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    seen = expected > 0
    assert counts[~seen].sum() == 0, "a token the target cannot sample was emitted"
    return float((((counts - expected) ** 2)[seen] / expected[seen]).sum())


def test_sampled_speculation_with_mtp_drafts_matches_the_target_distribution(mtp_install):
    """The token after the confirmed one, over many seeded rounds whose drafts the
    MTP head samples from its own q: its distribution is the target's."""
    runner = open_runner(mtp_install, draft=DraftPolicies.mtp(2))
    runner.prefill_chunk(PROMPT, 0)
    params = SamplingParams(temperature=1.0, top_k=6, seed=11)
    sampler = Sampler(params)
    drafter = MtpDrafter(runner.mtp_head, lambda: runner.mtp_track(None), sampler, 2)
    context = [*PROMPT, 7]
    first = drafter.propose(context, 2)
    logits = runner.verify(None, [7, *first.tokens], len(PROMPT))
    runner.accept(None, len(PROMPT), 0)  # only the target's first row matters below
    target = np.array(mx.softmax(sampler.warp(logits[0])))
    counts = np.zeros_like(target)
    trials, passed = 1500, 0
    for _ in range(trials):
        draft = drafter.propose(context, 1)  # sampled; the drafter rewinds its own step
        accepted, following = accept_sampled(logits[:2], draft, sampler)
        counts[draft.tokens[0] if accepted else following] += 1
        passed += accepted
    assert 0 < passed < trials  # both branches (a pass, a residual draw) were taken
    # 5 degrees of freedom: the 0.1% critical value is 20.5.
    assert _chi_square(counts, target) < 20.5


def test_a_sampled_reply_with_mtp_is_reproducible_by_seed(mtp_install):
    """The drafted sampling path end to end (the head's q, rejection sampling,
    the residual draw): a seed gives one reply, and the session holds it."""
    config = CONFIG.model_copy(update={"temperature": 0.8, "top_k": 8, "seed": 3})
    replies = []
    for _ in range(2):
        runner = open_runner(mtp_install, draft=DraftPolicies.mtp(2))
        done = generate(runner, load_text(mtp_install), PROMPT, config)
        assert done.stats.draft_proposed > 0 and len(done.tokens) == CONFIG.max_tokens
        assert runner.sessions()[0].record.tokens == [*PROMPT, *done.tokens[:-1]]
        replies.append(done.tokens)
    assert replies[0] == replies[1]


# -- the CLI -----------------------------------------------------------------------------------


def test_generate_json_reports_mtp_draft_counts(mtp_install, capsys):
    from turbospark.cli import main

    argv = ["generate", str(mtp_install), "--prompt", "abcabcabc", "--raw", "--json"]
    assert main([*argv, "--max-tokens", "12", "--draft", "mtp", "--draft-depth", "2"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["draft_proposed"] > 0
    assert stats["draft_proposed"] >= stats["draft_accepted"] >= 0
