"""Constrained decoding's per-token cost: llguidance (what the server uses) against xgrammar.

Both libraries compute, before every token, the set of ids the grammar
allows; turbospark turns that bitmask into an ``mx.where`` over the row's
logits (:class:`turbospark.generation.logits_processors.Grammar`). This measures, on one
realistic vocabulary (151,643 byte-level tokens, Qwen's size: the 256 bytes,
word pieces with and without a leading space and capital, numbers,
punctuation and JSON/code fragments, generated from a fixed seed), for a
``json_schema`` of moderate complexity and for ``json_object``:

- ``compile_s``: the grammar built for the vocabulary (llguidance: the
  tokenizer once, ``tokenizer_s``, then a matcher; xgrammar: ``TokenizerInfo``
  once, then ``compile_json_schema``/``compile_builtin_json_grammar``);
- ``mask_us``: the library alone per token, the bitmask computed and the
  next id accepted (median over the document's tokens, then over reps);
- ``step_us``: what a constrained row adds per token as served: the mask,
  unpacked into an MLX boolean mask, applied to float32 logits with
  ``mx.where`` and evaluated, and the id accepted.

The document decoded is a fixed compact JSON instance of the schema,
tokenized greedily by longest match (both libraries accept any tokenization
that spells valid text). Both must accept every token and end accepting, or
the row says why. xgrammar is optional (``uv sync --group bench``: it pulls
in torch); without it the section says so.

    uv run python bench/constrain.py [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

VOCAB_SIZE = 151_643
EOS = "<|endoftext|>"

# A moderate schema: nesting, an array of objects, enums, bounds, every scalar type.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "item": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["id", "item", "quantity", "price"],
                "additionalProperties": False,
            },
        },
    },
    "required": [
        "name",
        "age",
        "email",
        "active",
        "score",
        "role",
        "tags",
        "address",
        "orders",
    ],
    "additionalProperties": False,
}
INSTANCE: dict[str, Any] = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "active": True,
    "score": 98.25,
    "role": "editor",
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "orders": [
        {"id": 1, "item": "Difference Engine", "quantity": 2, "price": 1700.5},
        {"id": 2, "item": "Analytical Engine", "quantity": 1, "price": 17470.0},
    ],
}
OBJECT_INSTANCE: dict[str, Any] = {
    "city": "Paris",
    "days": [1, 2, 3],
    "hotel": {"name": "Le Petit", "stars": 4, "open": True},
    "note": None,
}

_SYLLABLES = [
    "a",
    "e",
    "i",
    "o",
    "u",
    "an",
    "ar",
    "as",
    "at",
    "be",
    "ca",
    "ce",
    "co",
    "de",
    "di",
    "el",
    "en",
    "er",
    "es",
    "et",
    "fo",
    "ge",
    "ha",
    "he",
    "hi",
    "in",
    "io",
    "is",
    "it",
    "la",
    "le",
    "li",
    "lo",
    "ma",
    "me",
    "mi",
    "mo",
    "na",
    "ne",
    "ni",
    "no",
    "nt",
    "on",
    "or",
    "ou",
    "pa",
    "pe",
    "pi",
    "po",
    "ra",
    "re",
    "ri",
    "ro",
    "sa",
    "se",
    "si",
    "so",
    "st",
    "ta",
    "te",
    "th",
    "ti",
    "to",
    "tr",
    "un",
    "ur",
    "us",
    "ve",
    "vi",
    "wa",
    "we",
    "wh",
]
_FRAGMENTS = [
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    '"',
    '":',
    '",',
    '":',
    '{"',
    '"}',
    '["',
    '"]',
    '{"name',
    '":"',
    '","',
    '":[',
    "]}",
    "}}",
    "]]",
    "\\n",
    '\\"',
    "==",
    "!=",
    "<=",
    ">=",
    "->",
    "=>",
    "::",
    ";",
    ";",
    ".",
    "..",
    "...",
    ",",
    ",",
    "#",
    "//",
    "/*",
    "*/",
    "<|",
    "|>",
    "_",
    "__",
    "-",
    "--",
    "+",
    "++",
    "*",
    "**",
    "/",
    "%",
    "&",
    "&&",
    "|",
    "||",
    "^",
    "~",
    "!",
    "?",
    "@",
    "$",
]


def _byte_level() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies store)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


BYTES = _byte_level()


def encode(text: str) -> str:
    return "".join(BYTES[b] for b in text.encode("utf-8"))


def realistic_vocab(size: int = VOCAB_SIZE, seed: int = 0) -> list[str]:
    """*size* distinct byte-level tokens: id 0 is the end token, then the 256
    bytes, JSON/code fragments, numbers, then generated word pieces (plain,
    leading space, capitalized, with trailing punctuation) until full."""
    rng = random.Random(seed)
    pieces = [*_FRAGMENTS, " ", "  ", "    ", "\n", "\n\n", "\t"]
    pieces += [str(n) for n in range(1000)] + [f" {n}" for n in range(1000)]
    vocab = [EOS, *(BYTES[b] for b in range(256))]
    seen = set(vocab)
    for text in pieces:
        token = encode(text)
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    while len(vocab) < size:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3, 3, 4))))
        form = rng.random()
        if form < 0.45:
            word = " " + word
        elif form < 0.6:
            word = " " + word.capitalize()
        elif form < 0.7:
            word = word.capitalize()
        if rng.random() < 0.08:
            word += rng.choice(['",', '":', ".", ",", '"', "(", ")"])
        token = encode(word)
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    return vocab


def tokenizer_json(vocab: list[str]) -> str:
    """An HF ``tokenizer.json`` (byte-level BPE) holding *vocab*, for llguidance."""
    return json.dumps(
        {
            "version": "1.0",
            "added_tokens": [
                {
                    "id": 0,
                    "content": EOS,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
            ],
            "normalizer": None,
            "pre_tokenizer": {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            },
            "post_processor": None,
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            },
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "vocab": {token: i for i, token in enumerate(vocab)},
                "merges": [],
            },
        }
    )


def tokenize(text: str, vocab: list[str]) -> list[int]:
    """Greedy longest match of *text*'s byte-level form over *vocab*."""
    ids = {token: i for i, token in enumerate(vocab)}
    longest = max(len(t) for t in vocab)
    encoded, out, at = encode(text), [], 0
    while at < len(encoded):
        for end in range(min(len(encoded), at + longest), at, -1):
            if encoded[at:end] in ids:
                out.append(ids[encoded[at:end]])
                at = end
                break
    return out


def _mask_to_mlx(bits: np.ndarray, vocab: int) -> mx.array:
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab]
    return mx.array(allowed.astype(np.bool_))


def _per_token(
    matcher_factory: Callable[[], Any],
    step: Callable[[Any, int, bool], bool],
    ids: list[int],
    reps: int,
    apply: bool,
) -> float:
    """Median over reps of the median per-token microseconds of *step*."""
    medians = []
    for _ in range(reps):
        matcher = matcher_factory()
        times = []
        for token in ids:
            started = time.perf_counter()
            if not step(matcher, token, apply):
                raise RuntimeError(f"token {token} was refused after {len(times)} tokens")
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
    return statistics.median(medians) * 1e6


def bench_llguidance(
    vocab: list[str], cases: dict[str, tuple[str, list[int]]], reps: int
) -> dict[str, Any]:
    started = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tokenizer_json(vocab), eos_token=0)
    out: dict[str, Any] = {
        "version": llguidance.__version__
        if hasattr(llguidance, "__version__")
        else _dist_version("llguidance"),
        "tokenizer_s": time.perf_counter() - started,
    }
    logits = mx.random.normal((len(vocab),))
    for name, (grammar, ids) in cases.items():
        started = time.perf_counter()
        llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        compile_s = time.perf_counter() - started

        def step(matcher: llguidance.LLMatcher, token: int, apply: bool) -> bool:
            bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
            if apply:
                mx.eval(mx.where(_mask_to_mlx(bits, len(vocab)), logits, -mx.inf))
            return bool(matcher.consume_token(token)) and not matcher.is_error()

        def fresh(grammar: str = grammar) -> llguidance.LLMatcher:
            return llguidance.LLMatcher(tokenizer, grammar, log_level=0)

        mask_us = _per_token(fresh, step, ids, reps, apply=False)
        step_us = _per_token(fresh, step, ids, reps, apply=True)
        end = fresh()
        for token in ids:
            end.consume_token(token)
        out[name] = {
            "compile_s": compile_s,
            "mask_us": mask_us,
            "step_us": step_us,
            "tokens": len(ids),
            "accepting": bool(end.is_accepting()),
        }
    return out


def bench_xgrammar(
    vocab: list[str], cases: dict[str, tuple[dict[str, Any] | None, list[int]]], reps: int
) -> dict[str, Any]:
    try:
        import torch
        import xgrammar as xgr
    except ImportError as exc:
        return {"error": f"xgrammar is not installed ({exc}); uv sync --group bench"}
    started = time.perf_counter()
    info = xgr.TokenizerInfo(
        vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=len(vocab), stop_token_ids=[0]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    out: dict[str, Any] = {
        "version": _dist_version("xgrammar"),
        "tokenizer_s": time.perf_counter() - started,
    }
    logits = mx.random.normal((len(vocab),))
    for name, (schema, ids) in cases.items():
        started = time.perf_counter()
        if schema is None:
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(",", ":")
            )
        compile_s = time.perf_counter() - started
        bitmask = xgr.allocate_token_bitmask(1, len(vocab))

        def step(matcher: Any, token: int, apply: bool, bitmask: torch.Tensor = bitmask) -> bool:
            matcher.fill_next_token_bitmask(bitmask)
            if apply:
                bits = bitmask[0].numpy()
                mx.eval(mx.where(_mask_to_mlx(bits, len(vocab)), logits, -mx.inf))
            return bool(matcher.accept_token(token))

        def fresh(compiled: Any = compiled) -> Any:
            return xgr.GrammarMatcher(compiled)

        mask_us = _per_token(fresh, step, ids, reps, apply=False)
        step_us = _per_token(fresh, step, ids, reps, apply=True)
        end = fresh()
        for token in ids:
            end.accept_token(token)
        out[name] = {
            "compile_s": compile_s,
            "mask_us": mask_us,
            "step_us": step_us,
            "tokens": len(ids),
            "accepting": bool(end.is_completed() or end.accept_token(0)),
        }
    return out


def _dist_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def bench_constrain(reps: int = 5, vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    vocab = realistic_vocab(vocab_size)
    documents = {
        "json_schema": (SCHEMA, json.dumps(INSTANCE, separators=(",", ":"))),
        "json_object": (None, json.dumps(OBJECT_INSTANCE, separators=(",", ":"))),
    }
    ids = {name: tokenize(text, vocab) for name, (_, text) in documents.items()}
    grammars = {
        name: llguidance.LLMatcher.grammar_from_json_schema(
            schema or {"type": "object"}, overrides={"whitespace_flexible": False}
        )
        for name, (schema, _) in documents.items()
    }
    return {
        "vocab_size": len(vocab),
        "documents": {
            name: {"chars": len(text), "tokens": len(ids[name])}
            for name, (_, text) in documents.items()
        },
        "llguidance": bench_llguidance(
            vocab, {name: (grammars[name], ids[name]) for name in documents}, reps
        ),
        "xgrammar": bench_xgrammar(
            vocab, {name: (schema, ids[name]) for name, (schema, _) in documents.items()}, reps
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = bench_constrain(args.reps, args.vocab_size)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
