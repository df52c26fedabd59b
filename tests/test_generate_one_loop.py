"""One decode loop: the library's and the CLI's generation run through the
server's engine, so the same request gives the same reply and the same stats
on either path, plain or drafted; and no second loop, nor a second writer of
a session's record, creeps back in."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from turbospark.errors import SessionPoolUnsupported
from turbospark.generation.drafters import Drafter, ReplayDrafter
from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import (
    Chunk,
    Completion,
    GenerationConfig,
    collect,
    generate,
)
from turbospark.generation.runner import Runner
from turbospark.policies import DraftPolicies
from turbospark.text import TextCodec, load_text

GENERATION = Path(__file__).parents[1] / "core" / "turbospark" / "generation"
PROMPT = [*range(3, 30), *range(3, 15)]  # a repeat, so prompt lookup finds matches
FOLLOW_UP = [*range(40, 52)]
TIMINGS = {"prefill_seconds", "decode_seconds", "queued_seconds"}


def server_path(
    runner: Runner, codec: TextCodec, ids: list[int], config: GenerationConfig, drafter: Any
) -> Completion:
    """The request as the server runs it: a job on a batching engine, stepped as
    :meth:`Engine.run` steps it, its chunks emitted to a callback."""
    engine = Engine(runner, codec, max_batch=8)
    got: list[Chunk | Exception] = []
    engine.submit(Job(ids=list(ids), config=config, emit=got.append, drafter=drafter))
    while engine.step():
        pass
    for item in got:
        if isinstance(item, Exception):
            raise item
    return collect(item for item in got if isinstance(item, Chunk))


def library_path(
    runner: Runner, codec: TextCodec, ids: list[int], config: GenerationConfig, drafter: Any
) -> Completion:
    return generate(runner, codec, ids, config, drafter=drafter)


CASES = {
    "plain": (DraftPolicies.off(), None, {}),
    "ngram": (DraftPolicies.ngram(min_match=1), None, {}),
    "ngram, sampled": (DraftPolicies.ngram(min_match=1), None, {"temperature": 0.8, "seed": 5}),
    "chained oracle": (DraftPolicies.off(), 0.9, {}),  # greedy rounds queued behind each other
    "drafts off by request": (DraftPolicies.ngram(min_match=1), None, {"draft": False}),
}


def _drafter(runner: Runner, accuracy: float | None, reference: list[int]) -> Drafter | None:
    if accuracy is None:
        return None
    return ReplayDrafter(reference, runner.vocab_size, 4, accuracy=accuracy, seed=1)


def _conversation(path: Path, draft: DraftPolicies, accuracy, knobs, run) -> list[Any]:
    """Two turns of one conversation and a third one elsewhere, on a pooled
    runner: replies, finish reasons, stats (timings aside) and the records."""
    codec = load_text(path)
    try:
        runner = Runner.open(
            path, context_length=256, dtype="float32", draft=draft, session_slots=2
        )
    except SessionPoolUnsupported:  # a family whose state cannot be parked: the live one only
        runner = Runner.open(path, context_length=256, dtype="float32", draft=draft)
    runner.set_prefix_reuse(True)
    config = GenerationConfig(max_tokens=40, stop_token_ids=[], **knobs)
    reference = [
        *PROMPT,
        *generate(Runner.open(path, dtype="float32"), codec, PROMPT, config).tokens,
    ]
    seen: list[Any] = []
    history = list(PROMPT)
    for ids in (history, None, [7, 8, 9, *PROMPT[:10]]):
        ids = ids if ids is not None else [*history, *FOLLOW_UP]
        done = run(runner, codec, ids, config, _drafter(runner, accuracy, reference))
        seen.append(
            (
                done.tokens,
                done.text,
                done.finish_reason,
                done.stats.model_dump(exclude=TIMINGS),
                [list(s.record.tokens) for s in runner.sessions()],
            )
        )
        history = [*ids, *done.tokens]
    return seen


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn", "qwen4_exp"])
def test_the_library_and_the_server_give_the_same_reply(family, case, request):
    """The same requests through ``generate`` and through a server's engine:
    token for token, the same stats (reuse reasons, drafts proposed, accepted
    and probed) and the same sessions left behind."""
    path = request.getfixturevalue(f"{family}_install")
    draft, accuracy, knobs = CASES[case]
    library = _conversation(path, draft, accuracy, knobs, library_path)
    server = _conversation(path, draft, accuracy, knobs, server_path)
    assert library == server
    if case != "plain" and case != "drafts off by request":
        assert any(turn[3]["draft_probed"] or turn[3]["draft_proposed"] for turn in library)


def test_mtp_drafting_is_the_same_on_both_paths(mtp_install):
    draft = DraftPolicies.mtp()
    library = _conversation(mtp_install, draft, None, {}, library_path)
    server = _conversation(mtp_install, draft, None, {}, server_path)
    assert library == server
    assert any(turn[3]["draft_proposed"] for turn in library)


def test_stop_strings_stop_ids_and_limits_end_both_paths_alike(gemma4_install):
    codec = load_text(gemma4_install)
    free = generate(Runner.open(gemma4_install), codec, PROMPT, GenerationConfig(max_tokens=24))
    text = free.text
    stop = next((text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip()), "")
    for config in (
        GenerationConfig(max_tokens=24, stop=[stop] if stop else []),
        GenerationConfig(max_tokens=24, stop_token_ids=[free.tokens[min(5, len(free.tokens) - 1)]]),
        GenerationConfig(max_tokens=0),
        GenerationConfig(max_tokens=1),
    ):
        replies = [
            run(Runner.open(gemma4_install), codec, PROMPT, config, None)
            for run in (library_path, server_path)
        ]
        library, server = ((r.tokens, r.text, r.finish_reason) for r in replies)
        assert library == server, config


# -- the shape of the code ---------------------------------------------------------------

FEEDING = {"produce", "produce_prefill", "prefill_chunk", "feed", "verify", "accept", "take_back"}


def _calls(module: str) -> set[str]:
    tree = ast.parse((GENERATION / module).read_text())
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }


def test_generate_has_no_decode_loop_of_its_own():
    """``stream_generate`` drives the engine; it feeds nothing and samples nothing
    itself, so a second loop cannot drift from the server's."""
    tree = ast.parse((GENERATION / "generate.py").read_text())
    assert not FEEDING & _calls("generate.py")
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.While | ast.For)]
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert "Engine" in imported and not {"Sampler", "speculation_for", "settle"} & imported


def test_only_the_runner_writes_a_session_record():
    """A session's record is written by one owner, the runner's feed path
    (``Runner.fed``); the engine and the rest of the loop never write it."""
    for path in GENERATION.glob("*.py"):
        source = path.read_text()
        writes = source.count(".record.write(")
        assert writes == (1 if path.name == "runner.py" else 0), path.name
