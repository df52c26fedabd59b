"""An install's tokenizer, chat template and stop ids as one object, and streaming decode.

:func:`load_text` reads the files; :class:`TextCodec` encodes, decodes and
renders chats through the checkpoint's own template; :class:`StreamDecoder`
turns ids arriving one at a time into text deltas.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from turbospark.errors import InstallError, InvalidInput
from turbospark.text.templates import compile_template
from turbospark.text.tokenizer_files import StopIds, TokenizerConfig, read_validated


class ChatMessage(BaseModel):
    """One message as the chat template sees it."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str


class TextCodec:
    """Tokenizer + chat template + stop ids of one install."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: Iterable[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self._template = None if chat_template is None else compile_template(chat_template)
        self._single: dict[int, str] = {}  # decode([id]) by id: StreamDecoder's window start

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of *text*; ``add_special_tokens`` applies the tokenizer's
        post-processor (e.g. a leading ``<bos>`` for a raw completion prompt).
        Chat prompts already carry their specials from the template.

        Through ``encode_batch``, which releases the GIL (``encode`` holds it
        throughout), so a long prompt tokenized on a worker thread does not stall
        the server's event loop."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_one(self, token: int) -> str:
        """``decode([token])``, remembered: streaming decodes each emitted token
        alone once more as the start of its next window."""
        text = self._single.get(token)
        if text is None:
            text = self._single[token] = self.decode([token])
        return text

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render *messages* through the checkpoint's own jinja2 template."""
        if self._template is None:
            raise InvalidInput(
                "this install has no chat_template in tokenizer_config.json; "
                "send a plain completion prompt instead"
            )
        if not messages:
            raise InvalidInput("messages is empty: a chat request needs at least one message")
        plain = [m.model_dump() if isinstance(m, ChatMessage) else dict(m) for m in messages]
        try:
            return self._template.render(
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidInput(f"the chat template refused these messages: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt ids for a chat: the rendered template, tokenised without adding specials."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        )

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenisation: feed ids one at a time, get text deltas.

    Decoding a token alone is wrong for byte-fallback and SentencePiece
    tokenizers (a multi-byte character spans tokens; a leading space depends on
    the previous token), so each step decodes a short window of recent ids and
    emits only what extends the window's previous text, holding back an
    incomplete character (U+FFFD) until the next token completes it.
    """

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here have been emitted
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far: the text a client received, which a
        whole decode of the ids need not equal (a window's boundaries)."""
        return "".join(self._emitted)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the end of the stream)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        window = self.ids[self._prefix : self._read]
        # Usually one token (the last one emitted): a remembered decode, so a
        # step costs one tokenizer call.
        before = (
            self._codec.decode_one(window[0]) if len(window) == 1 else self._codec.decode(window)
        )
        after = self._codec.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        self._emitted.append(after[len(before) :])
        return self._emitted[-1]


def load_text(path: str | Path) -> TextCodec:
    """Read an install's (or an HF checkpoint's) tokenizer, template and stop ids.

    Stop ids are the union of ``generation_config.json``'s and ``config.json``'s
    ``eos_token_id`` and the tokenizer's ``eos_token``, as ``transformers``
    generation stops on any of them.
    """
    root = Path(path)
    file = root / "tokenizer.json"
    if not file.is_file():
        raise InstallError(
            f"{file} not found: the install has no tokenizer; re-import it from a Hugging Face "
            "checkpoint that ships tokenizer.json"
        )
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise InstallError(f"{file} could not be loaded by tokenizers: {exc}") from exc
    config = read_validated(TokenizerConfig, root / "tokenizer_config.json")
    template = config.chat_template
    jinja_file = root / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    eos_ids = read_validated(StopIds, root / "generation_config.json").ids()
    eos_ids |= read_validated(StopIds, root / "config.json").ids()
    if (
        config.eos_token is not None
        and (eos := tokenizer.token_to_id(config.eos_token)) is not None
    ):
        eos_ids.add(eos)
    return TextCodec(
        tokenizer,
        chat_template=template,
        bos_token=config.bos_token,
        eos_token=config.eos_token,
        eos_token_ids=eos_ids,
    )
