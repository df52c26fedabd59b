"""Reply-proof reuse over loopback with the openai client: a re-sent reply is fed
as the ids it was generated as, so the next turn continues its session through
the reply even where re-tokenising the text would give other ids; an edited
reply is not taken for ours; and a checkpoint kept where the generation prompt
starts serves the next turn of a template that re-renders the reply otherwise
(Qwen3.5's thinking block). Every second turn is held equal to the same turn
on a server that reuses nothing."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from serving import client, serving, serving_with_disk

from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import GenerationConfig
from turbospark.server import ThreadedServer
from turbospark.server import chat_ids as chat_ids_module
from turbospark.server.chat_ids import chat_ids
from turbospark.sessions.replies import ReplyIndex
from turbospark.text import TextCodec, load_text

ASK = [{"role": "user", "content": "Say it twice."}]
THEN = {"role": "user", "content": "And once more?"}
# Biased toward two tokens and penalised for repeating them, greedy decoding
# alternates: qwen_gdn's "h", "e" (re-tokenised as the merge "he"), gemma4's
# "h" and "<unused0>" (a special token the text drops).
BIAS = {"gemma4": {15: 10, 102: 7}, "qwen_gdn": {14: 10, 11: 7}}
SKEW = {"frequency_penalty": 2.0, "presence_penalty": 2.0}


def model_of(server: ThreadedServer) -> str:
    return server.service.model_id  # type: ignore[attr-defined]


def chat(server: ThreadedServer, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client(server).chat.completions.create(
        model=model_of(server), messages=messages, max_tokens=6, temperature=0.0, **extra
    )


def biased(family: str) -> dict[str, Any]:
    return {"logit_bias": {str(t): b for t, b in BIAS[family].items()}, **SKEW}


def in_record(first: Any) -> int:
    """Tokens of turn 1 its session holds: the prompt and every reply token fed
    (a reply cut by max_tokens never feeds its last token; a stop id is never one)."""
    choice = first.choices[0]
    generated = first.usage.completion_tokens
    return first.usage.prompt_tokens + generated - (choice.finish_reason == "length")


@pytest.fixture(scope="module", params=["gemma4", "qwen_gdn"])
def family(request: pytest.FixtureRequest) -> tuple[str, Path, TextCodec]:
    path = request.getfixturevalue(f"{request.param}_install")
    return request.param, path, load_text(path)


@pytest.fixture(scope="module")
def servers(
    family: tuple[str, Path, TextCodec],
) -> Iterator[tuple[ThreadedServer, ThreadedServer]]:
    """A server that reuses sessions and one that reuses nothing, on one install."""
    _, path, codec = family
    with serving(path, codec, slots=2) as warm, serving(path, codec, slots=2, reuse=False) as cold:
        yield warm, cold


def test_a_resent_reply_is_reused_through_its_generated_ids(
    family: tuple[str, Path, TextCodec], servers: tuple[ThreadedServer, ThreadedServer]
) -> None:
    name, _, codec = family
    warm, cold = servers
    first = chat(warm, ASK, **biased(name))
    text = first.choices[0].message.content
    # The reply's text re-tokenises to other ids than were generated.
    assert len(codec.encode(text)) != first.usage.completion_tokens
    turn = [*ASK, {"role": "assistant", "content": text}, THEN]
    second = chat(warm, turn)
    assert second.usage.prompt_tokens_details.cached_tokens == in_record(first)
    assert second.usage.turbospark["reuse_reason"] == "extends"
    assert "generated ids of 1 re-sent" in second.usage.turbospark["reuse_detail"]
    # The uninterrupted path: the same conversation, every prompt prefilled whole.
    alone = chat(cold, ASK, **biased(name))
    assert alone.choices[0].message.content == text
    again = chat(cold, turn)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens == second.usage.prompt_tokens
    assert again.choices[0].message.content == second.choices[0].message.content


def test_a_resent_reply_is_reused_through_its_ids_after_a_restart(
    family: tuple[str, Path, TextCodec],
    servers: tuple[ThreadedServer, ThreadedServer],
    tmp_path: Path,
) -> None:
    """With a session directory the index of replies is kept beside the
    sessions: after a restart, the session restored from disk continues
    through the re-sent reply's generated ids, as a live one does."""
    name, path, codec = family
    _, cold = servers
    with serving_with_disk(path, codec, tmp_path, slots=2) as before:
        first = chat(before, ASK, **biased(name))
    text = first.choices[0].message.content
    assert len(codec.encode(text)) != first.usage.completion_tokens
    turn = [*ASK, {"role": "assistant", "content": text}, THEN]
    with serving_with_disk(path, codec, tmp_path, slots=2) as after:
        second = chat(after, turn)
    assert second.usage.prompt_tokens_details.cached_tokens == in_record(first)
    assert second.usage.turbospark["reuse_reason"] == "restored_from_disk"
    assert "generated ids of 1 re-sent" in second.usage.turbospark["reuse_detail"]
    again = chat(cold, turn)  # every prompt prefilled whole
    assert again.choices[0].message.content == second.choices[0].message.content


def test_the_reply_index_file_is_read_back_and_skips_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "replies.jsonl"
    replies = ReplyIndex(max_replies=2, path=path)
    for text, ids in (("a", [1]), ("b", [2, 3]), ("c", [4])):
        replies.add([9], text, ids)
    with path.open("a") as torn:
        torn.write('{"text": "d", "prompt"')  # a crash mid-line
    back = ReplyIndex(max_replies=2, path=path)
    assert not back.knows("a") and back.ids_of("b", lambda: [9]) == (2, 3)
    assert back.ids_of("c", lambda: [9]) == (4,) and len(back) == 2
    assert len(path.read_text().splitlines()) == 2  # rewritten from what is kept
    for n in range(5):  # past twice the replies kept, the file is rewritten
        back.add([9], f"e{n}", [n])
    assert len(path.read_text().splitlines()) <= 4
    assert ReplyIndex(max_replies=2, path=path).ids_of("e4", lambda: [9]) == (4,)


def test_an_edited_reply_is_not_taken_for_ours(
    family: tuple[str, Path, TextCodec], servers: tuple[ThreadedServer, ThreadedServer]
) -> None:
    name, _, _ = family
    warm, cold = servers
    first = chat(warm, ASK, **biased(name))
    turn = [*ASK, {"role": "assistant", "content": first.choices[0].message.content + "!"}, THEN]
    second = chat(warm, turn)
    detail = second.usage.turbospark["reuse_detail"]
    assert "not replies this server generated" in detail and "generated ids" not in detail
    assert second.usage.prompt_tokens_details.cached_tokens < in_record(first)
    if name == "qwen_gdn":  # recurrent state: back to the prompt-end checkpoint
        assert second.usage.turbospark["reuse_reason"] == "checkpoint"
        assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    chat(cold, ASK, **biased(name))
    assert chat(cold, turn).choices[0].message.content == second.choices[0].message.content


THINK = {"chat_template_kwargs": {"enable_thinking": True}}


def test_thinking_turns_resume_where_the_generation_prompt_began(
    qwen_gdn_install: Path,
) -> None:
    """The history drops the reply's thinking block, so the second prompt leaves
    the first's record inside its generation prompt, after the assistant header
    both render: the checkpoint taken there serves it, and the reply is a fresh
    server's."""
    codec = load_text(qwen_gdn_install)
    opening = len(codec.encode("<think>\n"))
    with serving(qwen_gdn_install, codec, slots=2) as warm:
        first = chat(warm, ASK, extra_body=THINK)
        reply = first.choices[0].message.content or "ok"
        turn = [*ASK, {"role": "assistant", "content": reply}, THEN]
        second = chat(warm, turn, extra_body=THINK)
    assert second.usage.turbospark["reuse_reason"] == "checkpoint"
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - opening
    with serving(qwen_gdn_install, codec, slots=2) as fresh:
        alone = chat(fresh, turn, extra_body=THINK)
    assert alone.usage.prompt_tokens_details.cached_tokens == 0
    assert alone.choices[0].message.content == second.choices[0].message.content
    assert alone.choices[0].message.reasoning_content == (  # type: ignore[attr-defined]
        second.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    )


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_turns_without_thinking_resume_after_the_assistant_header(qwen_gdn_install: Path) -> None:
    """With thinking off the generation prompt holds an empty think block the
    history does not render: the next turn leaves the record after the
    assistant header both share, where the checkpoint was taken, not where the
    generation prompt began. The reply is a fresh server's."""
    codec = load_text(qwen_gdn_install)
    bare = codec.apply_chat_template(ASK, add_generation_prompt=False)
    header = len(codec.encode(bare + "<|im_start|>assistant\n"))
    with serving(qwen_gdn_install, codec, slots=2) as warm:
        first = chat(warm, ASK, extra_body=NO_THINKING)
        turn = [*ASK, {"role": "assistant", "content": first.choices[0].message.content}, THEN]
        second = chat(warm, turn, extra_body=NO_THINKING)
    assert header > len(codec.encode(bare))
    assert second.usage.turbospark["reuse_reason"] == "checkpoint"
    assert second.usage.prompt_tokens_details.cached_tokens == header
    with serving(qwen_gdn_install, codec, slots=2) as fresh:
        alone = chat(fresh, turn, extra_body=NO_THINKING)
    assert alone.usage.prompt_tokens_details.cached_tokens == 0
    assert alone.choices[0].message.content == second.choices[0].message.content


def _render(codec: TextCodec) -> Any:
    return lambda messages, generation_prompt: codec.apply_chat_template(
        messages, add_generation_prompt=generation_prompt
    )


def test_a_reply_the_template_trims_is_spliced_with_its_whitespace(
    gemma4_install: Path,
) -> None:
    """Gemma's template trims a reply: its generated ids are spliced whole, the
    whitespace as generated (the session holds it), and the note says so. A
    reply is spliced only after the prompt it followed."""
    codec = load_text(gemma4_install)
    render = _render(codec)
    asked = codec.encode(render(ASK, True))
    replies = ReplyIndex()
    replies.add(asked, " hh ", [7, 15, 102, 15, 7])
    messages = [*ASK, {"role": "assistant", "content": " hh "}, THEN]
    built = chat_ids(messages, render, codec, replies, boundary=False)
    start = len(render(ASK, True))
    assert built.text[start : start + 3] == "hh<"  # the template's rendering: trimmed
    after = codec.encode(built.text[start + 2 :])
    assert built.ids == [*asked, 7, 15, 102, 15, 7, *after]
    assert "1 of them with the whitespace the template trims" in built.note
    replies.add(asked, "hh", [15, 102, 15])
    messages[1] = {"role": "assistant", "content": "hh"}
    built = chat_ids(messages, render, codec, replies, boundary=False)
    assert built.ids == [*asked, 15, 102, 15, *after] and "trims" not in built.note
    # A client's text holding the placeholder cannot misplace the reply's ids.
    forged = [*messages[:2], {"role": "user", "content": "\ue000turbospark-reply-0\ue001"}]
    built = chat_ids(forged, render, codec, replies, boundary=False)
    assert built.ids == codec.encode(built.text) and "verbatim or trimmed" in built.note
    other = [{"role": "user", "content": "Say it thrice."}, messages[1], THEN]
    built = chat_ids(other, render, codec, replies, boundary=False)
    assert built.ids == codec.encode(built.text)
    assert "1 re-sent assistant message(s) are not replies" in built.note


def test_a_reply_the_template_rewrites_costs_the_other_replies_nothing(
    qwen_gdn_install: Path,
) -> None:
    """Qwen's template drops what a reply holds before a literal ``</think>``:
    that reply is tokenised as text, and the reply before it keeps its
    generated ids (the session holds them: the whole earlier prompt is reused)."""
    codec = load_text(qwen_gdn_install)
    render = _render(codec)
    asked = codec.encode(render(ASK, True))
    replies = ReplyIndex()
    replies.add(asked, "hh", [14, 14])
    turn = [*ASK, {"role": "assistant", "content": "hh"}, THEN]
    second = chat_ids(turn, render, codec, replies, boundary=False).ids
    replies.add(second, "a</think>b", [11, 4, 12])
    third = [*turn, {"role": "assistant", "content": "a</think>b"}, ASK[0]]
    built = chat_ids(third, render, codec, replies, boundary=False)
    assert built.ids[: len(second)] == second and "b<|im_end|>" in built.text
    assert built.ids[len(second) :] == codec.encode(built.text[len(render(turn, True)) :])
    assert "generated ids of 1 re-sent" in built.note
    assert "does not render 1 re-sent repl(y/ies) verbatim or trimmed" in built.note


@pytest.mark.parametrize("separators", [True, False])
def test_the_generation_prompt_start_is_found_only_where_the_ids_split_there(
    qwen_gdn_install: Path, monkeypatch: pytest.MonkeyPatch, separators: bool
) -> None:
    """Found through the added token the generation prompt opens with, or by
    tokenising the text before it again: the same position either way."""
    if not separators:
        monkeypatch.setattr(chat_ids_module, "_separators", lambda tokenizer: ())
    codec = load_text(qwen_gdn_install)
    built = chat_ids(ASK, _render(codec), codec, ReplyIndex(), boundary=True)
    bare = codec.apply_chat_template(ASK, add_generation_prompt=False)
    assert built.checkpoint_at == len(codec.encode(bare)) < len(built.ids)
    assert built.ids == codec.encode(built.text) and built.note == ""
    # A generation prompt whose ids do not start where its text does: none.
    joined = lambda messages, generation_prompt: (  # noqa: E731
        codec.apply_chat_template(messages, add_generation_prompt=False)
        + ("he" if generation_prompt else "h")
    )
    assert chat_ids(ASK, joined, codec, ReplyIndex(), boundary=True).checkpoint_at is None


def test_the_reply_index_is_bounded_least_recently_used_first() -> None:
    replies = ReplyIndex(max_replies=2, max_ids=5)
    replies.add([9], "a", [1, 2])
    replies.add([9], "b", [3])
    assert replies.ids_of("a", lambda: [9]) == (1, 2)  # now the most recent
    assert replies.ids_of("a", lambda: [8]) is None  # after another prompt
    replies.add([9], "c", [4])
    assert not replies.knows("b") and len(replies) == 2
    replies.add([9], "d", [5, 6, 7, 8])  # 5 ids would be 7 held: "a" goes too
    assert replies.ids_of("a", lambda: [9]) is None and replies.ids_of("d", lambda: [9])
    replies.add([9], "e", [])  # no ids: nothing to feed
    assert len(replies) == 2 and not replies.knows("e")
    replies.add([9], "", [1])  # ids that all decode to nothing: re-sent empty
    assert replies.ids_of("", lambda: [9]) == (1,)


def test_prompts_prefilled_together_checkpoint_where_each_generation_prompt_begins(
    qwen_gdn_install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a batched prefill a row leaves the merged state at its mark, is
    checkpointed, and goes on; each next turn resumes from its own mark, and
    every reply equals a fresh runner's."""
    from test_engine import Collector, alone, open_runner, run_all

    codec = load_text(qwen_gdn_install)
    groups: list[int] = []
    feed = Engine._feed_group
    monkeypatch.setattr(
        Engine, "_feed_group", lambda self, g, b: groups.append(len(g.rows)) or feed(self, g, b)
    )
    engine = Engine(open_runner(qwen_gdn_install), codec, max_batch=4)
    config = GenerationConfig(max_tokens=4, temperature=0.0, stop_token_ids=[], chunk_size=64)
    prompts = [[1, 20 + i, 30, 40, 50, 60, 70 + i, 5, 1, 7, 8] for i in range(2)]
    marks = [7, 9]
    firsts = [
        Job(ids=p, config=config, emit=Collector(), checkpoint_at=at)
        for p, at in zip(prompts, marks, strict=True)
    ]
    run_all(engine, [(0, job) for job in firsts])
    assert max(groups) == 2, "the two prompts were never prefilled together"
    for prompt, at in zip(prompts, marks, strict=True):
        ids = [*prompt[:at], 90, 91]
        job = Job(ids=ids, config=config, emit=Collector())
        run_all(engine, [(0, job)])
        stats = job.emit.chunks[-1].stats
        assert (stats.reuse_reason, stats.reused_tokens) == ("checkpoint", at)
        assert job.emit.tokens == alone(qwen_gdn_install, codec, ids, config).tokens


# The concurrency benchmark's clients, few and short: streamed replies of random
# weights with ``ignore_eos``, each re-sent exactly as streamed. One client is
# pushed toward newlines (a reply the template trims: Gemma's ``trim``, Qwen's
# ``lstrip('\n')``), one toward a special token (a reply that streams as
# nothing and is re-sent empty). Qwen's template reads a literal ``</think>``
# in a reply as the end of reasoning and drops what came before it, so the
# reply would not be in the next prompt: its clients never sample it.
NEWLINE = {"gemma4": 6, "qwen_gdn": 5}
SILENT = {"gemma4": 102, "qwen_gdn": 125}
NO_THINK_END = {"gemma4": {}, "qwen_gdn": {"4": -100}}
REPLY = 12


def stream_turns(server: ThreadedServer, name: str, index: int, turns: int) -> list[dict[str, Any]]:
    """One client's chat: each turn the previous messages, the reply as it
    streamed, and a new question; per turn its usage, finish and text."""
    bias = dict(NO_THINK_END[name])
    if index == 1:
        bias[str(NEWLINE[name])] = 6
    if index == 2:
        bias[str(SILENT[name])] = 30
    messages: list[dict[str, Any]] = []
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Client {index}, question {turn}?"})
        events = client(server).chat.completions.create(
            model=model_of(server), messages=messages, max_tokens=REPLY, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, logit_bias=bias,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, finish, usage = "", None, None
        for event in events:
            for choice in event.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
            usage = event.usage or usage
        assert usage is not None
        out.append({"usage": usage, "finish": finish, "text": text})
        messages.append({"role": "assistant", "content": text})
    return out


def concurrent_chats(server: ThreadedServer, name: str, clients: int, turns: int) -> list[Any]:
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda i: stream_turns(server, name, i, turns), range(clients)))


@pytest.mark.slow
def test_concurrent_streamed_chats_reuse_each_whole_prompt_and_reply(
    family: tuple[str, Path, TextCodec],
) -> None:
    """Four clients at once, three turns each: every turn after the first has
    the previous prompt and every fed token of the previous reply cached (a
    reply cut by ``max_tokens`` never feeds its last token), through the
    replies' generated ids, trimmed and empty ones included. A server that
    reuses nothing builds the same prompts and gives the same replies."""
    name, path, codec = family
    # As many slots as conversations, as the benchmark serves them: with turns
    # in flight the pool holds empty slots, and those go first.
    with serving(path, codec, slots=4) as warm:
        chats = concurrent_chats(warm, name, 4, 3)
    assert chats[1][0]["text"] != chats[1][0]["text"].strip()
    assert chats[2][0]["text"] == "" and chats[2][0]["usage"].completion_tokens == REPLY
    for turns in chats:
        for turn, (before, now) in enumerate(itertools.pairwise(turns), start=1):
            assert before["finish"] == "length"
            usage = now["usage"]
            held = before["usage"].prompt_tokens + before["usage"].completion_tokens - 1
            assert usage.prompt_tokens_details.cached_tokens == held, usage.turbospark
            assert usage.turbospark["reuse_reason"] == "extends"
            assert f"generated ids of {turn} re-sent" in usage.turbospark["reuse_detail"]
    assert "whitespace the template trims" in chats[1][1]["usage"].turbospark["reuse_detail"]
    with serving(path, codec, slots=4, reuse=False) as cold:
        alone = concurrent_chats(cold, name, 4, 3)
    for turns, others in zip(chats, alone, strict=True):
        assert [t["text"] for t in turns] == [t["text"] for t in others]
        assert [t["usage"].prompt_tokens for t in turns] == [
            t["usage"].prompt_tokens for t in others
        ]
