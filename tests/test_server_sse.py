"""Pre-encoded stream events equal the chunk models they stand in for."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark.server.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Delta,
    TextChoice,
    TextCompletion,
)
from turbospark.server.sse import TextEvent, sse


def chat_chunk(text: str, index: int = 0) -> ChatCompletionChunk:
    choice = ChatChunkChoice(index=index, delta=Delta(content=text))
    return ChatCompletionChunk(id="chatcmpl-x", created=1, model="m", choices=[choice])


def text_chunk(text: str, index: int = 0) -> TextCompletion:
    return TextCompletion(
        id="cmpl-x", created=1, model="m", choices=[TextChoice(index=index, text=text)]
    )


def payload(event: str) -> object:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event.removeprefix("data: "))


@settings(max_examples=200, deadline=None)
@given(text=st.text(), index=st.integers(0, 15))
def test_a_text_event_is_the_models_own_event(text: str, index: int) -> None:
    for make in (chat_chunk, text_chunk):
        event = TextEvent(make(TextEvent.MARK, index))(text)
        assert payload(event) == payload(sse(make(text, index)))
        event.encode()  # what the response sends: valid UTF-8


@pytest.mark.parametrize("text", ['"', "\\", "\n\r\t", "\x00\x1f", "é中🙂", "</script>", ""])
def test_escapes_and_unicode_byte_for_byte(text: str) -> None:
    """The JSON around the text is the model's bytes; the text is valid JSON either way."""
    event = TextEvent(chat_chunk(TextEvent.MARK))(text)
    assert payload(event) == payload(sse(chat_chunk(text)))
    if text.isprintable() and '"' not in text and "\\" not in text:
        assert event == sse(chat_chunk(text))


def test_a_model_without_the_marker_is_refused() -> None:
    with pytest.raises(ValueError, match="marker exactly once"):
        TextEvent(chat_chunk("no marker"))
