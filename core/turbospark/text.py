"""Text for an install: its tokenizer, its chat template, its stop ids.

Two jobs, both about the files a Hugging Face checkpoint ships beside its
weights (``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``):

* :func:`synthetic_text_files` writes a small but *real* tokenizer for random
  -weight installs, so every path a real checkpoint takes (the chat template,
  special tokens, stop ids, streaming detokenisation) is exercised by tests.
* :func:`load_text` reads those files from any install into a :class:`TextCodec`,
  which renders the checkpoint's own jinja2 chat template the way
  ``transformers`` does (sandboxed, ``trim_blocks``/``lstrip_blocks``).
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tokenizers import AddedToken, Tokenizer, decoders, models, processors

from turbospark.errors import InstallError, InvalidInput
from turbospark.hookspecs import ArchConfig

PAD, BOS, EOS, START_OF_TURN, END_OF_TURN, UNK = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<unk>",
)
SPECIALS = [PAD, BOS, EOS, START_OF_TURN, END_OF_TURN, UNK]
PAD_ID, BOS_ID, EOS_ID, START_OF_TURN_ID, END_OF_TURN_ID, UNK_ID = range(len(SPECIALS))

# Characters in the order they get ids: the template's own characters first so
# a vocabulary too small for all of printable ASCII still renders every prompt.
_CHARS = (
    "\n " + string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
)
MIN_VOCAB = len(SPECIALS) + len("\n user model")

# Gemma's chat template (system text folded into the first user turn, roles
# must alternate, ``assistant`` rendered as ``model``), as shipped in
# ``tokenizer_config.json`` by Google's checkpoints.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}"
    "{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}"
    "{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def synthetic_text_files(arch: ArchConfig) -> dict[str, str]:
    """Tokenizer files for a synthetic install whose vocabulary is ``arch.vocab_size``.

    Ids 0-5 are the specials (``<pad> <bos> <eos> <start_of_turn> <end_of_turn>
    <unk>``), then one token per character (newline, space, letters, digits,
    punctuation: as many as fit), then ``<extra_N>`` up to the vocabulary size,
    so every id the model can emit decodes. Stop ids are ``<eos>`` and
    ``<end_of_turn>`` (as Gemma's ``generation_config.json`` lists them); a
    family's synthetic arch should carry ``eos_token_id=EOS_ID``.
    """
    vocab_size = arch.vocab_size
    if vocab_size < MIN_VOCAB:
        raise InvalidInput(
            f"vocab_size {vocab_size} is too small for a synthetic tokenizer: it needs at least "
            f"{MIN_VOCAB} ids (6 specials plus the chat template's characters); "
            "use vocab_size >= 128"
        )
    chars = _CHARS[: vocab_size - len(SPECIALS)]
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(chars)})
    extras = [f"<extra_{i}>" for i in range(vocab_size - len(vocab))]
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(extras)})

    # A BPE model with no merges and no pre-tokenizer splits text into single
    # characters and maps each to its id; unknown characters become <unk>.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIALS + extras]
    )
    tokenizer.decoder = decoders.Fuse()  # concatenate pieces; the default joins with spaces
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": 1_000_000,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": GEMMA_CHAT_TEMPLATE,
    }
    generation_config = {
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, END_OF_TURN_ID],
        "pad_token_id": PAD_ID,
    }
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
        "generation_config.json": json.dumps(generation_config, indent=2) + "\n",
    }


# -- reading an install's text files --------------------------------------------------


def _token_text(value: Any) -> str | None:
    """``tokenizer_config.json`` writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class TokenizerConfig(BaseModel):
    """The parts of ``tokenizer_config.json`` generation needs (HF's own keys)."""

    model_config = ConfigDict(extra="ignore")

    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    @field_validator("bos_token", "eos_token", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        return _token_text(value)

    @field_validator("chat_template", mode="before")
    @classmethod
    def _default_template(cls, value: Any) -> str | None:
        # Newer checkpoints ship a list of named templates; "default" is the chat one.
        if isinstance(value, list):
            named = {item["name"]: item["template"] for item in value}
            return named.get("default") or next(iter(named.values()), None)
        return value


class StopIds(BaseModel):
    """``eos_token_id`` as ``generation_config.json`` / ``config.json`` write it."""

    model_config = ConfigDict(extra="ignore")

    eos_token_id: int | list[int] | None = None
    text_config: dict[str, Any] | None = None

    def ids(self) -> set[int]:
        value = self.eos_token_id
        if value is None and self.text_config is not None:
            value = self.text_config.get("eos_token_id")
        if value is None:
            return set()
        return {value} if isinstance(value, int) else set(value)


_M = TypeVar("_M", bound=BaseModel)


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise InstallError(f"{file} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    if not isinstance(data, dict):
        raise InstallError(f"{file} must hold a JSON object")
    return data


def _validated(model: type[_M], file: Path) -> _M:
    if not file.is_file():
        return model()
    try:
        return model.model_validate(_read_json(file))
    except ValidationError as exc:
        raise InstallError(f"{file} is malformed: {exc.errors()[0]['msg']}") from exc


class ChatMessage(BaseModel):
    """One message as the chat template sees it."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


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
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            # The environment transformers uses, so a checkpoint's template renders the same.
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(chat_template)

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

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the end of the stream)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        before = self._codec.decode(self.ids[self._prefix : self._read])
        after = self._codec.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]


class StopStrings:
    """Cuts a text stream at the first stop string, holding back a possible partial match.

    ``feed`` returns the text safe to emit now; once a stop string completes,
    ``stopped`` is set and the text before it is the last thing returned.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped: str | None = None
        self._pending = ""

    def feed(self, delta: str) -> str:
        if self.stopped is not None:
            return ""
        text = self._pending + delta
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            index, stop = min(hits)
            self.stopped = stop
            self._pending = ""
            return text[:index]
        hold = max((_partial_suffix(text, s) for s in self.stops), default=0)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """At the end of the stream a held partial match is ordinary text."""
        text, self._pending = self._pending, ""
        return "" if self.stopped is not None else text


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of *text* that is a proper prefix of *stop*."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


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
    config = _validated(TokenizerConfig, root / "tokenizer_config.json")
    template = config.chat_template
    jinja_file = root / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    eos_ids = _validated(StopIds, root / "generation_config.json").ids()
    eos_ids |= _validated(StopIds, root / "config.json").ids()
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
