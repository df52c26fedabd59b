"""A chat prompt's ids: re-sent replies fed as the ids generated, and where the next turn leaves the generation prompt.

Sessions are reused by token content (docs/SEMANTICS.md), so two things about
how a prompt is tokenised decide how much of the conversation is reused:

- A re-sent assistant reply whose text is exactly what this server generated
  is fed as the ids it generated (:class:`~turbospark.sessions.replies.ReplyIndex`),
  not as its text tokenised again (which may split differently, or lose a
  special token the text dropped): the template is rendered with a unique
  placeholder for that content, the pieces around it are tokenised, and the
  ids are spliced in. Only where the template renders the content verbatim or
  trimmed of whitespace at its edges (Gemma's ``trim``, Qwen's
  ``lstrip('\\n')``): the ids then carry that whitespace as generated, since
  the session holds the reply as generated and the trimmed text would leave it
  at the reply's first token. A message rendered otherwise is tokenised as
  text, and the others are still spliced.
- Where the next turn leaves the generation prompt: a template that
  re-renders the reply otherwise on the next turn (Qwen3.5's thinking block,
  or the empty one without thinking, dropped from history) leaves the session
  after the assistant header both render, so the engine checkpoints
  non-rewindable state at that position too (``Job.checkpoint_at``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turbospark.errors import TurbosparkError
from turbospark.sessions.replies import ReplyIndex
from turbospark.text import TextCodec

# Private-use code points around a counter: text no client sends and no template writes.
_OPEN, _CLOSE = "\ue000turbospark-reply-", "\ue001"

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt)


# How a template may render an assistant's content that still holds the reply
# but for whitespace at its edges, in the order tried: verbatim, then as Jinja's
# ``trim`` and the ``strip`` family (whitespace, or newlines only) leave it.
_RENDERINGS: tuple[Callable[[str], str], ...] = (
    lambda c: c,
    str.strip,
    str.lstrip,
    str.rstrip,
    lambda c: c.strip("\n"),
    lambda c: c.lstrip("\n"),
    lambda c: c.rstrip("\n"),
)


@dataclass(frozen=True)
class ChatIds:
    ids: list[int]
    text: str  # the rendered prompt (the ids encode it, re-sent replies as generated)
    checkpoint_at: int | None  # where the next turn leaves the generation prompt (None: not known)
    note: str  # how re-sent replies were fed, for the reuse detail ("" when none was sent)


@dataclass(frozen=True)
class _Pieces:
    """The prompt's text around each spliced message's content (one more piece
    than messages) and what the template rendered for each content."""

    around: list[str]
    rendered: list[str]


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
    reply this server generated after the same prompt fed as its generated ids,
    and, with *boundary*, where its generation prompt starts. *check* sees the
    rendered prompt before anything is tokenised (a refusal of an overlong one)."""
    text = render(messages, True)
    if check is not None:
        check(text)
    sent = [i for i, m in enumerate(messages) if _resent(m, replies)]
    known = [i for i in sent if replies.knows(messages[i]["content"])]
    spliceable = known
    pieces = _pieces(messages, known, render, text) if known else None
    if pieces is None and len(known) > 1:
        # One message the template rewrites must not cost the others their ids
        # (the session holds them): splice those rendered verbatim or trimmed.
        spliceable = [i for i in known if _pieces(messages, [i], render, text) is not None]
        pieces = _pieces(messages, spliceable, render, text) if spliceable else None
    if pieces is None:
        spliceable = []
    rewritten = len(known) - len(spliceable)
    notes = []
    if rewritten:
        notes.append(
            f"the template does not render {rewritten} re-sent repl(y/ies) verbatim or "
            "trimmed of whitespace, so they were tokenised as text"
        )
    ids: list[int] = []
    found = spliced = trimmed = 0
    rest = text  # the text after the last reply spliced in, still to tokenise
    if pieces is not None:
        rest = pieces.around[0]
        for k, i in enumerate(spliceable):
            content, shown = messages[i]["content"], pieces.rendered[k]
            reply = replies.ids_of(content, functools.partial(_with, ids, rest, codec))
            if reply is None:  # the same text, after another prompt: not this reply
                rest += shown + pieces.around[k + 1]
                continue
            ids = _with(ids, rest, codec) + list(reply)
            rest = pieces.around[k + 1]
            found, spliced = found + 1, spliced + len(reply)
            trimmed += shown != content
    ids = _with(ids, rest, codec)
    if found:
        notes.insert(
            0,
            f"the generated ids of {found} re-sent repl(y/ies) ({spliced} token(s)) were used "
            "in place of their re-tokenised text"
            + (
                f" ({trimmed} of them with the whitespace the template trims, as generated)"
                if trimmed
                else ""
            ),
        )
    if found < len(sent) - rewritten:
        notes.append(
            f"{len(sent) - rewritten - found} re-sent assistant message(s) are not "
            "replies this server generated after the same prompt (edited, or from elsewhere) "
            "and were tokenised as text"
        )
    at = _generation_start(messages, render, codec, text, rest, ids) if boundary else None
    return ChatIds(ids, text, at, "; ".join(notes))


def _resent(message: dict[str, Any], replies: ReplyIndex) -> bool:
    """Whether *message* re-sends a reply's text: an assistant's content, or an
    empty one (a reply of ids that decode to nothing) where some such reply is
    known and no tool call stands in its place."""
    if message["role"] != "assistant" or not isinstance(message.get("content"), str):
        return False
    return bool(message["content"]) or (
        not message.get("tool_calls") and replies.knows(message["content"])
    )


def _with(ids: list[int], text: str, codec: TextCodec) -> list[int]:
    """*ids*, then *text* tokenised."""
    return [*ids, *codec.encode(text)] if text else list(ids)


def _pieces(
    messages: list[dict[str, Any]],
    known: list[int],
    render: Render,
    text: str,
) -> _Pieces | None:
    """The prompt's text around the content of each message in *known*, and how
    each content was rendered, or None when the template does not render each
    content, verbatim or trimmed (:data:`_RENDERINGS`), exactly once where its
    placeholder goes."""
    marked = [dict(m) for m in messages]
    marks = []
    for n, i in enumerate(known):
        marks.append(f"{_OPEN}{n}{_CLOSE}")
        marked[i]["content"] = marks[-1]
    try:
        shaped = render(marked, True)
    except TurbosparkError:  # a template that inspects the content may refuse a placeholder
        return None
    around = []
    rest = shaped
    for mark in marks:
        if rest.count(mark) != 1:
            return None
        before, rest = rest.split(mark)
        around.append(before)
    around.append(rest)
    if not text.startswith(around[0]):
        return None
    rendered = _match(text, len(around[0]), [messages[i]["content"] for i in known], around[1:])
    return None if rendered is None else _Pieces(around, rendered)


def _match(text: str, at: int, contents: list[str], after: list[str]) -> list[str] | None:
    """How each of *contents* was rendered so that *text* from *at* is each
    rendering followed by its piece of *after*, to the end; None when no
    choice of renderings gives *text* (tried in order, backtracking)."""
    if not contents:
        return [] if at == len(text) else None
    seen = set()
    for form in _RENDERINGS:
        shown = form(contents[0])
        if shown in seen or not text.startswith(shown + after[0], at):
            continue
        seen.add(shown)
        rest = _match(text, at + len(shown) + len(after[0]), contents[1:], after[1:])
        if rest is not None:
            return [shown, *rest]
    return None


def _generation_start(
    messages: list[dict[str, Any]],
    render: Render,
    codec: TextCodec,
    text: str,
    last: str,
    ids: list[int],
) -> int | None:
    """Where the next turn's prompt leaves this one's ids: the prompt rendered
    without its generation prompt must be a prefix of the prompt, and the next
    turn's rendering of the reply may share the generation prompt's opening
    too (Qwen's ``<|im_start|>assistant\\n`` before a think block the history
    drops), so the position is the end of what the prompt shares with the
    conversation rendered with a reply and a question after it; the ids must
    split there (the last piece's ids are those of its text before that point,
    then the rest's own)."""
    try:
        bare = render(messages, False)
    except TurbosparkError:
        return None
    if not bare or len(bare) >= len(text) or not text.startswith(bare):
        return None
    shared = _next_turn_shares(messages, render, text, len(bare))
    for end in dict.fromkeys((shared, len(bare))):  # the later first
        at = _split(codec, text[end:], last, ids)
        if at is not None:
            return at
    return None


def _next_turn_shares(messages: list[dict[str, Any]], render: Render, text: str, bare: int) -> int:
    """How much of *text* (at least *bare* characters) the next turn's prompt
    renders alike before the reply's content: the conversation with a reply
    and a question appended, up to the reply's placeholder."""
    reply, question = f"{_OPEN}reply{_CLOSE}", f"{_OPEN}question{_CLOSE}"
    after = [*messages, {"role": "assistant", "content": reply}]
    try:
        following = render([*after, {"role": "user", "content": question}], False)
    except TurbosparkError:
        return bare
    if following.count(reply) != 1 or not following.startswith(text[:bare]):
        return bare
    head = following.split(reply)[0]
    end = bare
    while end < min(len(head), len(text)) and head[end] == text[end]:
        end += 1
    return end


def _split(codec: TextCodec, suffix: str, last: str, ids: list[int]) -> int | None:
    """The index in *ids* where the prompt's final *suffix* starts, when the ids
    split there, else None."""
    if not suffix or len(suffix) > len(last) or not last.endswith(suffix):
        return None
    tail = codec.encode(suffix)
    if not tail or ids[len(ids) - len(tail) :] != tail:
        return None
    if not suffix.startswith(_separators(codec.tokenizer)):
        # Tokenising the head again is the proof: a merge may cross the boundary.
        head = codec.encode(last[: len(last) - len(suffix)])
        if ids[len(ids) - len(head) - len(tail) : len(ids) - len(tail)] != head:
            return None
    return len(ids) - len(tail)


@functools.cache
def _separators(tokenizer: Any) -> tuple[str, ...]:
    """The added tokens that take no whitespace from the text before them: the
    tokenizer splits the text at them before anything else, so text before one
    is tokenised as it would be alone (a generation prompt opening with one,
    as ChatML's ``<|im_start|>``, needs no second pass over the prompt)."""
    added = tokenizer.get_added_tokens_decoder().values()
    return tuple(t.content for t in added if t.content and not t.lstrip)
