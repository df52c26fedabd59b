"""What every family's synthetic install shares: seeded random tensors under
checkpoint names, a small tokenizer of the family's real kind with its chat
template, the check of the size knobs, and the write through the same
:func:`~turbospark.loading.install.write_install` a real import uses.

The tokenizer matters as much as the weights: a synthetic install is served,
benchmarked against mlx-lm and loaded by ``transformers``, so it must
tokenize the way the family's real checkpoints do. :class:`SyntheticText`
describes one family's text (its tokenizer kind, special tokens, stop tokens
and chat template) and writes its files at any vocabulary size.
"""

from __future__ import annotations

import inspect
import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from turbospark.contract.hookspecs import ArchConfig
from turbospark.errors import InvalidInput
from turbospark.loading.install import write_install
from turbospark.text.templates import GEMMA_CHAT_TEMPLATE, QWEN_CHAT_TEMPLATE

DTYPES = ("float32", "float16", "bfloat16")

# Bumped whenever what a synthetic install holds changes (2: each family's own
# tokenizer kind and chat template), so caches of built installs key on it.
SYNTHETIC_FORMAT = 2


# -- weights ------------------------------------------------------------------------


class RandomWeights:
    """Named random tensors from one seeded generator, collected in :attr:`tensors`
    (checkpoint name -> array) for :func:`write_synthetic`; each method adds one and
    returns nothing. Nothing is neutral (norm weights are not all ones), so a
    skipped norm or a mis-wired gate shows.

    Each tensor is drawn in float64 and kept in float32 (what :func:`write_synthetic`
    casts from anyway), so an 8B-parameter install holds 32 GB, not 64, while it
    is built."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def linear(self, name: str, shape: tuple[int, ...]) -> None:
        """``(..., out, in)`` with unit-variance outputs for unit-variance inputs."""
        self.tensors[name] = _f32(self.rng.normal(0.0, shape[-1] ** -0.5, shape))

    def scale(self, name: str, shape: tuple[int, ...], spread: float = 0.2) -> None:
        """A positive scale around 1 (norm weights used as is, layer scalars)."""
        self.tensors[name] = _f32(1.0 + self.rng.uniform(-spread, spread, shape))

    def centred(self, name: str, shape: tuple[int, ...], spread: float = 0.2) -> None:
        """A zero-centred norm weight (the model multiplies by ``1 + w``)."""
        self.tensors[name] = _f32(self.rng.uniform(-spread, spread, shape))


def _f32(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float32)


# -- text --------------------------------------------------------------------------

# Characters in the order they get ids: the templates' own characters (newline,
# space, the lowercase role names) first, so a vocabulary too small for all of
# printable ASCII still renders every chat prompt.
_CHARS = (
    "\n " + string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
)
_TEMPLATE_CHARS = 2 + len(string.ascii_lowercase)

# A few merges of a real English BPE, applied when the vocabulary has room
# after the characters, so a byte-level install is a BPE with merges, not a
# character table.
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("Ġ", "a"), ("r", "e"),
    ("o", "n"), ("Ġt", "he"), ("Ġ", "s"), ("a", "t"), ("e", "n"), ("n", "d"), ("Ġ", "w"),
    ("o", "u"), ("i", "s"), ("Ġ", "o"), ("e", "s"), ("Ġ", "i"), ("o", "r"), ("in", "g"),
    ("Ġ", "c"), ("e", "d"), ("Ġ", "f"),
]  # fmt: skip

_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _byte_level(text: str) -> str:
    """*text* in GPT-2's byte-to-unicode alphabet (space is ``Ġ``, newline ``Ċ``)."""
    return "".join(piece for piece, _ in _BYTE_LEVEL.pre_tokenize_str(text))


@dataclass(frozen=True)
class SyntheticText:
    """A family's text as its real checkpoints ship it, writable at any vocabulary size.

    ``kind`` is how the family's real tokenizer works:

    * ``"sentencepiece"`` (Gemma, Llama 2): spaces normalised to ``▁``, byte
      fallback, and the decoder mlx-lm recognises as SentencePiece;
    * ``"byte_level"`` (Qwen, Llama 3, GPT-2): a regex pre-split, then bytes mapped
      to GPT-2's printable alphabet, merged by BPE, decoded by ``ByteLevel``.

    Ids ``0 .. len(specials) - 1`` are *specials* in order, then the *added*
    tokens (ones that decode as text even when specials are skipped); then one token per
    character (as many as fit); then, for ``byte_level``, a few real merges; then
    reserved specials up to the vocabulary size, so every id the model can emit
    decodes. Characters outside the vocabulary become ``unk`` (sentencepiece)
    or are dropped (byte_level without their byte), in ``transformers`` as here.
    """

    kind: Literal["sentencepiece", "byte_level"]
    specials: tuple[str, ...]
    eos: str  # tokenizer_config.json's eos_token
    stops: tuple[str, ...]  # generation_config.json's eos_token_id, as tokens
    chat_template: str
    bos: str | None = None  # prepended to raw prompts by the post-processor
    pad: str | None = None
    unk: str | None = None  # sentencepiece only: byte_level drops what it cannot encode
    split_pattern: str | None = None  # byte_level: the pre-tokenizer's regex
    nfc: bool = False  # byte_level: NFC-normalise first (Qwen)
    added: tuple[str, ...] = ()  # whole-word tokens that are not special (Qwen's <think>)
    tokenizer_class: str = "PreTrainedTokenizerFast"

    def id(self, token: str) -> int:
        """The id of special or added *token*."""
        return (*self.specials, *self.added).index(token)

    @property
    def eos_ids(self) -> list[int]:
        return [self.id(token) for token in self.stops]

    @property
    def min_vocab(self) -> int:
        return len(self.specials) + len(self.added) + _TEMPLATE_CHARS

    def files(self, vocab_size: int) -> dict[str, str]:
        """``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``."""
        if vocab_size < self.min_vocab:
            raise InvalidInput(
                f"vocab_size {vocab_size} is too small for a synthetic tokenizer: it needs at "
                f"least {self.min_vocab} ids ({len(self.specials) + len(self.added)} special "
                "tokens plus the chat "
                "template's characters); use vocab_size >= 128"
            )
        tokenizer = self._tokenizer(vocab_size)
        config = {
            "add_bos_token": self.bos is not None,
            "add_eos_token": False,
            "bos_token": self.bos,
            "eos_token": self.eos,
            "pad_token": self.pad,
            "unk_token": self.unk,
            "model_max_length": 1_000_000,
            "tokenizer_class": self.tokenizer_class,
            "chat_template": self.chat_template,
        }
        generation = {"bos_token_id": self.bos and self.id(self.bos), "eos_token_id": self.eos_ids}
        if self.pad is not None:
            generation["pad_token_id"] = self.id(self.pad)
        return {
            "tokenizer.json": tokenizer.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "generation_config.json": json.dumps(generation, indent=2) + "\n",
        }

    def _tokenizer(self, vocab_size: int) -> Tokenizer:
        whole = [*self.specials, *self.added]
        chars = _CHARS[: vocab_size - len(whole)]
        if self.kind == "sentencepiece":
            pieces = [ch.replace(" ", "▁") for ch in chars]
        else:
            pieces = [_byte_level(ch) for ch in chars]
        vocab = {tok: i for i, tok in enumerate([*whole, *pieces])}
        merges: list[tuple[str, str]] = []
        if self.kind == "byte_level":
            for left, right in _MERGES:
                if len(vocab) < vocab_size and left in vocab and right in vocab:
                    merges.append((left, right))
                    vocab[left + right] = len(vocab)
        reserved = [
            f"<unused{i}>" if self.kind == "sentencepiece" else f"<|reserved_{i}|>"
            for i in range(vocab_size - len(vocab))
        ]
        vocab.update({tok: len(vocab) + i for i, tok in enumerate(reserved)})

        if self.kind == "sentencepiece":
            tokenizer = Tokenizer(
                models.BPE(vocab=vocab, merges=merges, unk_token=self.unk, byte_fallback=True)
            )
            tokenizer.normalizer = normalizers.Replace(" ", "▁")
            tokenizer.decoder = decoders.Sequence(
                [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            )
        else:
            tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
            if self.nfc:
                tokenizer.normalizer = normalizers.NFC()
            split = pre_tokenizers.Split(Regex(self.split_pattern or ""), behavior="isolated")
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, _BYTE_LEVEL])
            tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in [*self.specials, *reserved]]
        )
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in self.added])
        if self.bos is not None:
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{self.bos} $A",
                pair=f"{self.bos} $A $B",
                special_tokens=[(self.bos, self.id(self.bos))],
            )
        return tokenizer


GEMMA_TEXT = SyntheticText(
    kind="sentencepiece",
    specials=("<pad>", "<bos>", "<eos>", "<|turn>", "<turn|>", "<unk>"),  # Gemma 4's turns
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    unk="<unk>",
    stops=("<eos>", "<turn|>"),  # as Gemma 4's generation_config.json lists them
    chat_template=GEMMA_CHAT_TEMPLATE,
)

QWEN_TEXT = SyntheticText(
    kind="byte_level",
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    # In the vocabulary, so mlx-lm sees a thinking model and leaves the template's
    # default (no empty think block), as it does for a real Qwen3.5 checkpoint.
    added=("<think>", "</think>"),
    eos="<|im_end|>",
    pad="<|endoftext|>",
    stops=("<|im_end|>", "<|endoftext|>"),
    chat_template=QWEN_CHAT_TEMPLATE,
    # Qwen3.5's pre-tokenizer (as transformers' Qwen3_5Tokenizer rebuilds it).
    split_pattern=(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    nfc=True,
    tokenizer_class="Qwen2Tokenizer",
)


# -- the install ------------------------------------------------------------------------


def write_synthetic(
    path: Path,
    arch: ArchConfig,
    model_id: str,
    tensors: dict[str, np.ndarray | mx.array],
    dtype: str,
    text: SyntheticText,
) -> ArchConfig:
    """Cast *tensors* to *dtype* and write the install with *text*'s tokenizer files."""
    if dtype not in DTYPES:
        raise InvalidInput(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    target = getattr(mx, dtype)
    weights = {}
    for name, value in tensors.items():
        # Cast now, one tensor at a time: left lazy, every float32 copy would
        # be held at once until the write evaluates them.
        weights[name] = mx.array(np.asarray(value, dtype=np.float32)).astype(target)
        mx.eval(weights[name])
    write_install(
        path, arch=arch, model_id=model_id, weights=weights, extra_files=text.files(arch.vocab_size)
    )
    return arch


def build_checked(
    family: str, build: Callable[..., ArchConfig], path: Path, dims: dict[str, Any]
) -> ArchConfig:
    """Call ``build(path, **dims)`` after refusing dims it does not take, by name."""
    known = set(inspect.signature(build).parameters) - {"path"}
    unknown = sorted(set(dims) - known)
    if unknown:
        raise InvalidInput(
            f"{family} synthetic installs have no dim(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    return build(path, **dims)
