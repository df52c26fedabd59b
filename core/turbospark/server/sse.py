"""Server-sent events, and the pre-encoded chunk a stream sends for each token.

A streamed reply sends one event per token per choice. Building a pydantic
chunk model for each and serialising it cost the event loop about a tenth of
a millisecond per event on a 2-core CPU (``bench/server_step.py``: the loop's
CPU time per decode step), time the loop holds the GIL the runner thread needs
to build the next step. Most events differ only in their text, so a stream
serialises its chunk model once with a marker for the text and then fills
the text in (:class:`TextEvent`). The JSON around the text is the model's own
serialisation, so the bytes are the ones the model would write, but for the
request's fixed ``created`` time, which OpenAI's streams also keep fixed.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

_MARK = "\u2063turbospark-text\u2063"  # INVISIBLE SEPARATOR: no real text carries this marker
# json.dumps(text, ensure_ascii=False) builds this encoder anew on every call.
_TEXT_JSON = json.JSONEncoder(ensure_ascii=False).encode


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One SSE event: a model, a JSON object, or text already encoded (``[DONE]``)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_none=False)
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


class TextEvent:
    """The SSE event of *model* (whose one text field holds :data:`MARK`) for any text.

    ``TextEvent(ChatCompletionChunk(..., delta=Delta(content=TextEvent.MARK)))(text)``
    is ``sse`` of that model with ``content=text``."""

    MARK = _MARK

    def __init__(self, model: BaseModel) -> None:
        encoded = model.model_dump_json(exclude_none=False)
        marker = json.dumps(_MARK, ensure_ascii=False)
        if encoded.count(marker) != 1:
            raise ValueError("a text event's model must hold the marker exactly once")
        head, tail = encoded.split(marker)
        self._head, self._tail = f"data: {head}", f"{tail}\n\n"

    def __call__(self, text: str) -> str:
        return f"{self._head}{_TEXT_JSON(text)}{self._tail}"
