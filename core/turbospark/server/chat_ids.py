"""A chat prompt's ids: re-sent replies fed as the ids generated, and where the generation prompt starts.

Sessions are reused by token content (docs/SEMANTICS.md), so two things about
how a prompt is tokenised decide how much of the conversation is reused:

- A re-sent assistant reply whose text is exactly what this server generated
  is fed as the ids it generated (:class:`~turbospark.sessions.replies.ReplyIndex`),
  not as its text tokenised again (which may split differently, or lose a
  special token the text dropped): the template is rendered with a unique
  placeholder for that content, the pieces around it are tokenised, and the
  ids are spliced in. Only where the template renders the content verbatim;
  otherwise the prompt is tokenised as text.
- Where the generation prompt starts: a template that re-renders the reply
  otherwise on the next turn (Qwen3.5's thinking block, dropped from history)
  leaves the session there, so the engine checkpoints non-rewindable state at
  that position too (``Job.checkpoint_at``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turbospark.errors import TurbosparkError
from turbospark.sessions.replies import ReplyIndex
from turbospark.text import TextCodec

# Private-use code points around a counter: text no client sends and no template writes.
_OPEN, _CLOSE = "\ue000turbospark-reply-", "\ue001"

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt)


@dataclass(frozen=True)
class ChatIds:
    ids: list[int]
    text: str  # the rendered prompt the ids encode
    checkpoint_at: int | None  # where the generation prompt starts in ids (None: not known)
    note: str  # how re-sent replies were fed, for the reuse detail ("" when none was sent)


def chat_ids(
    messages: list[dict[str, Any]],
    render: Render,
    codec: TextCodec,
    replies: ReplyIndex,
    *,
    boundary: bool,
    check: Callable[[str], None] | None = None,
) -> ChatIds:
    """The prompt of *messages* (template dicts), its ids with every re-sent
    reply this server generated fed as its generated ids, and, with *boundary*,
    where its generation prompt starts. *check* sees the rendered prompt before
    anything is tokenised (a refusal of an overlong one)."""
    text = render(messages, True)
    if check is not None:
        check(text)
    sent = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("content")]
    ours = {i: replies.ids_of(messages[i]["content"]) for i in sent}
    found = {i: ids for i, ids in ours.items() if ids is not None}
    notes = []
    if len(found) < len(sent):
        notes.append(
            f"{len(sent) - len(found)} re-sent assistant message(s) are not text this server "
            "generated (edited, or from elsewhere) and were tokenised as text"
        )
    pieces = _pieces(messages, found, render, text) if found else None
    if found and pieces is None:
        notes.append(
            "the template does not render the re-sent replies verbatim, so they were "
            "tokenised as text"
        )
        found = {}
    if pieces is None:
        pieces = [text]
    ids: list[int] = []
    spliced = 0
    for k, piece in enumerate(pieces):
        if piece:
            ids.extend(codec.encode(piece))
        if k < len(found):
            reply = list(found.values())[k]
            ids.extend(reply)
            spliced += len(reply)
    if found:
        notes.insert(
            0,
            f"the generated ids of {len(found)} re-sent repl(y/ies) ({spliced} token(s)) "
            "were used in place of their re-tokenised text",
        )
    at = _generation_start(messages, render, codec, text, pieces[-1], ids) if boundary else None
    return ChatIds(ids, text, at, "; ".join(notes))


def _pieces(
    messages: list[dict[str, Any]],
    found: dict[int, tuple[int, ...]],
    render: Render,
    text: str,
) -> list[str] | None:
    """The prompt's text around each found reply's content (one more piece than
    replies), or None when the template does not render each content verbatim
    exactly once where its placeholder goes."""
    marked = [dict(m) for m in messages]
    marks = []
    for n, i in enumerate(found):
        marks.append(f"{_OPEN}{n}{_CLOSE}")
        marked[i]["content"] = marks[-1]
    try:
        shaped = render(marked, True)
    except TurbosparkError:  # a template that inspects the content may refuse a placeholder
        return None
    pieces = []
    rest = shaped
    for mark in marks:
        if rest.count(mark) != 1:
            return None
        before, rest = rest.split(mark)
        pieces.append(before)
    pieces.append(rest)
    contents = [messages[i]["content"] for i in found]
    joined = pieces[0] + "".join(c + p for c, p in zip(contents, pieces[1:], strict=True))
    return pieces if joined == text else None


def _generation_start(
    messages: list[dict[str, Any]],
    render: Render,
    codec: TextCodec,
    text: str,
    last: str,
    ids: list[int],
) -> int | None:
    """Where the generation prompt's ids start: the prompt rendered without it
    must be a prefix of the prompt, and the ids must split there (the last
    piece's ids are those of its text before the generation prompt, then the
    generation prompt's own)."""
    try:
        bare = render(messages, False)
    except TurbosparkError:
        return None
    if not bare or len(bare) >= len(text) or not text.startswith(bare):
        return None
    suffix = text[len(bare) :]
    if len(suffix) > len(last) or not last.endswith(suffix):
        return None
    head, tail = codec.encode(last[: len(last) - len(suffix)]), codec.encode(suffix)
    if not tail or ids[len(ids) - len(head) - len(tail) :] != head + tail:
        return None
    return len(ids) - len(tail)
