"""Window fitting: a conversation too long for the context loses its oldest turns.

Opt-in (``serve --context-overflow drop-turns``, or a Responses request's
``truncation: "auto"``); by default an overlong prompt is refused. A *turn* is
a user message and everything up to the next one (the replies, an assistant's
tool calls and their results), so dropping whole turns never splits a tool
exchange and leaves a conversation that starts, after its system prompt, with
a user message, as every family's template requires. The system prompt and the
last turn are never dropped. The fewest turns that make the prompt fit with
room for the reply are dropped; a client resending the same conversation the
next time drops the same turns, so the session kept from its last request
still extends the new prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel

from turbospark.server.errors import APIError
from turbospark.server.schemas import Message

ContextOverflow = Literal["refuse", "drop-turns"]


class Dropped(BaseModel):
    """What fitting dropped: messages, and the prompt tokens that went with them."""

    messages: int = 0
    tokens: int = 0


def turn_starts(messages: Sequence[Message]) -> tuple[int, list[int]]:
    """Where the conversation begins after the leading system messages, and
    where each of its turns begins (the first at that start, the others at
    each later user message)."""
    begin = 0
    while begin < len(messages) and messages[begin].role in ("system", "developer"):
        begin += 1
    starts = [begin] + [i for i in range(begin + 1, len(messages)) if messages[i].role == "user"]
    return begin, starts


def fit(
    messages: list[Message],
    encode: Callable[[list[Message]], list[int]],
    room: int,
    context: int,
) -> tuple[list[int], Dropped]:
    """The prompt ids of *messages* with the fewest oldest turns dropped that
    leave *room* tokens for the reply within *context*; a 400 naming the fix
    when even the system prompt and the last turn alone do not fit. Fewer
    dropped turns never give a shorter prompt, so the count is a binary search
    (a few renders, not one per turn)."""
    full = encode(messages)
    if len(full) + room <= context:
        return full, Dropped()
    begin, starts = turn_starts(messages)

    def kept(k: int) -> list[Message]:
        return messages[:begin] + messages[starts[k] :]

    last = len(starts) - 1
    shortest = encode(kept(last)) if last > 0 else full
    if len(shortest) + room > context:
        dropped = starts[last] - begin
        raise APIError(
            400,
            f"the prompt is {len(shortest)} tokens with its {dropped} older message(s) dropped "
            f"(the system prompt and the last turn are kept), and the reply needs {room} more, "
            f"past the context length of {context}; shorten the last turn, lower max_tokens or "
            "serve with a larger --context-length",
            param="messages",
            code="context_length_exceeded",
        )
    encoded = {0: full, last: shortest}

    def ids_of(k: int) -> list[int]:
        if k not in encoded:
            encoded[k] = encode(kept(k))
        return encoded[k]

    low, high = 1, last  # kept(high) fits; kept(low - 1) does not
    while low < high:
        middle = (low + high) // 2
        if len(ids_of(middle)) + room <= context:
            high = middle
        else:
            low = middle + 1
    best = ids_of(high)
    return best, Dropped(messages=starts[high] - begin, tokens=len(full) - len(best))
