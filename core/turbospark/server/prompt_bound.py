"""A lower bound on a prompt's token count from its length in characters.

A prompt too long for the context is refused before it is tokenized, because
tokenizing megabytes takes seconds. The bound must never refuse a prompt that
fits, so it is derived from the tokenizer's own pipeline and used only where
it is sound:

* the **model** maps every token to one vocabulary string, and a token never
  covers more text characters than its string has characters: byte-level
  strings have one character per byte (a text character is at least one
  byte), ``▁`` stands for one space, byte-fallback ``<0x41>`` strings and
  WordPiece ``##`` prefixes overestimate. Added tokens are matched on their
  literal text. So with ``N`` the longest vocabulary string, ``t`` tokens
  cover at most ``t * N`` characters. Models that fuse a run of unknown
  characters into one token (``fuse_unk``, Unigram without byte fallback,
  WordPiece and WordLevel's whole-word ``[UNK]``) break this: no bound.
* the **normalizer** may shorten text first. Lowercasing, decompositions,
  ``Prepend`` and a literal ``Replace`` with a replacement at least as long
  never do. NFC/NFKC composition merges at most
  :data:`MAX_CANONICAL_DECOMPOSITION` characters into one (an output
  character's canonical decomposition contains every input character that
  composed into it), so they divide the bound by that. Anything that deletes
  characters (``Strip``, accent stripping, BERT's cleaning, SentencePiece's
  precompiled map) has no bound.
* the **pre-tokenizer** may drop characters (whitespace splitters, ``Split``
  with ``Removed``): no bound. Splitting, byte-level mapping and ``Metaspace``
  keep every character.

So a prompt of ``C`` characters is at least ``ceil(C / (N * shrink))`` tokens.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer

# The longest canonical decomposition of one code point (U+1F82 is four);
# tests/test_server_limits.py recomputes it from unicodedata.
MAX_CANONICAL_DECOMPOSITION = 4

_SAME_OR_LONGER_NORMALIZERS = {"Lowercase", "NFD", "NFKD", "Prepend"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


class PromptBound:
    """``min_tokens(chars)``: no text of *chars* characters encodes to fewer tokens.

    ``chars_per_token`` is ``None`` where the tokenizer gives no sound bound
    (``why`` says which part); then ``min_tokens`` is 0 and prompts are
    checked after tokenizing only.
    """

    def __init__(self, chars_per_token: int | None, why: str) -> None:
        self.chars_per_token = chars_per_token
        self.why = why

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> PromptBound:
        spec = json.loads(tokenizer.to_str())
        shrink, why = _normalizer_shrink(spec.get("normalizer"))
        if shrink is None:
            return cls(None, why)
        if not _keeps_characters(spec.get("pre_tokenizer")):
            return cls(None, f"the pre-tokenizer may drop characters: {spec['pre_tokenizer']}")
        if (problem := _fuses_unknowns(spec["model"])) is not None:
            return cls(None, problem)
        longest = max(len(token) for token in tokenizer.get_vocab(with_added_tokens=True))
        return cls(
            longest * shrink,
            f"a token covers at most {longest} characters (the longest vocabulary string)"
            + (f", times {shrink} for the normalizer's composition" if shrink > 1 else ""),
        )

    def min_tokens(self, chars: int) -> int:
        if self.chars_per_token is None:
            return 0
        return math.ceil(chars / self.chars_per_token)


def _normalizer_shrink(spec: dict[str, Any] | None) -> tuple[int | None, str]:
    """How many input characters one normalized character may stand for (None: unbounded)."""
    if spec is None:
        return 1, "no normalizer"
    kind = spec["type"]
    if kind == "Sequence":
        total = 1
        for part in spec["normalizers"]:
            shrink, why = _normalizer_shrink(part)
            if shrink is None:
                return None, why
            total *= shrink
        return total, "a sequence of normalizers"
    if kind in _SAME_OR_LONGER_NORMALIZERS:
        return 1, kind
    if kind in _COMPOSING_NORMALIZERS:
        return MAX_CANONICAL_DECOMPOSITION, kind
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if literal and len(spec.get("content", "")) >= len(literal):
            return 1, "a literal Replace that does not shorten"
    return None, f"the normalizer may delete characters: {spec}"


def _keeps_characters(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec["type"]
    if kind == "Sequence":
        return all(_keeps_characters(part) for part in spec["pretokenizers"])
    if kind in {"Split", "Punctuation"}:
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _fuses_unknowns(spec: dict[str, Any]) -> str | None:
    kind = spec["type"]
    if kind == "BPE" and not (spec.get("unk_token") and spec.get("fuse_unk")):
        return None
    if kind == "Unigram" and spec.get("byte_fallback"):
        return None
    return f"the {kind} model may fuse many unknown characters into one token"
