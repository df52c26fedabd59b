"""CLI subcommands, one module each (see turbospark.cli).

A command module's top level imports only what building its parser needs;
MLX, the server and the conformance kit load inside ``run``, so ``turbospark
--help`` and the commands that do not need them start fast
(``tests/test_cli.py`` checks which modules a command imports).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy modules load in run(), so `turbospark --help` stays light
    from turbospark.loading.quantization import QuantSpec
    from turbospark.loading.sources import ModelSource
    from turbospark.policies import DraftPolicies
    from turbospark.text import TextCodec

MODEL_HELP = "an install, a checkpoint directory (config.json + safetensors) or a hub id org/name"

# turbospark.loading.quantization.MODES, written out so building a parser loads no MLX
# (tests/test_cli.py holds the two equal).
QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")


def add_quantize_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """``--quantize BITS [--group-size N] [--mode M]``, as ``mlx_lm.convert -q`` takes them."""
    parser.add_argument(
        "--quantize",
        type=int,
        metavar="BITS",
        help=f"{what}, quantized as `mlx_lm.convert -q --q-bits BITS` does (4 or 8; affine "
        "also takes 2, 3, 5, 6)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help="weights per scale with --quantize (affine: 32, 64 or 128, default 64; "
        "the other modes fix it)",
    )
    parser.add_argument(
        "--mode",
        choices=QUANT_MODES,
        default="affine",
        help="quantization mode with --quantize (default: affine)",
    )


def quantize_spec(args: argparse.Namespace) -> QuantSpec | None:
    """The settings :func:`add_quantize_flags`'s flags ask for, refused by flag."""
    from turbospark.errors import InvalidInput
    from turbospark.loading.convert import requested_spec

    if args.quantize is None:
        if args.group_size is not None or args.mode != "affine":
            raise InvalidInput("--group-size and --mode apply with --quantize BITS; add it")
        return None
    return requested_spec(args.quantize, args.group_size, args.mode)


def model_text(model: str | Path) -> tuple[ModelSource, TextCodec]:
    """What *model* names (resolved once: a hub id downloads or is found in the
    cache, a checkpoint is verified) and its tokenizer; the source is what the
    command then passes to ``Runner.open``, so nothing is resolved twice. A
    wrong directory is named as such, not as a missing tokenizer."""
    from turbospark.loading.sources import resolve_source
    from turbospark.text import load_text

    source = resolve_source(model)
    return source, load_text(source.path)


_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def prompt_ids(codec: TextCodec, prompt: str, raw: bool) -> list[int]:
    """A command's prompt as ids: through the chat template unless *raw* (or none)."""
    if raw or codec.chat_template is None:
        return codec.encode(prompt, add_special_tokens=True)
    return codec.encode_chat([{"role": "user", "content": prompt}])


def byte_size(text: str) -> int:
    """``512MiB``, ``2GiB``, ``1.5GB`` or plain bytes, for ``--max-parked-memory``."""
    number = text.strip().lower().rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text.strip().lower()[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        value = math.nan
    if not math.isfinite(value):  # 1e400 reads as infinity
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: use bytes or a unit like 512MiB, 2GiB, 1.5GB"
        )
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a size cannot be negative; use 0 or more, e.g. 512MiB"
        )
    return int(value)


def add_pool_memory_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-parked-memory",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="cap on the memory of parked sessions (e.g. 4GiB): the least recently used "
        "are evicted to fit (default: bounded by --session-slots alone)",
    )


def add_kv_cache_flags(parser: argparse.ArgumentParser) -> None:
    """``--kv-bits`` and ``--kv-group-size``, shared by generate, chat and serve
    (checked by ``Runner.open`` before any weight is read)."""
    parser.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        metavar="4|8",
        help="store attention keys/values quantized to 4 or 8 bits (mlx-lm's quantized K/V "
        "cache, from the first token): sessions take less memory and disk (default: full "
        "precision)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        default=None,
        metavar="N",
        help="values sharing one scale and bias in the quantized K/V cache: 32, 64 or 128, "
        "dividing the attention head dim (default 64, as mlx-lm)",
    )


def kv_cache_options(args: argparse.Namespace) -> dict[str, int | None]:
    """``Runner.open``'s ``kv_bits`` and ``kv_group_size`` from the flags; a
    group size without ``--kv-bits`` is refused by name (it would do nothing)."""
    from turbospark.errors import InvalidInput

    if args.kv_bits is None and args.kv_group_size is not None:
        raise InvalidInput(
            f"--kv-group-size {args.kv_group_size} sets the groups of a quantized K/V cache; "
            "add --kv-bits 4 or --kv-bits 8, or drop --kv-group-size"
        )
    group = 64 if args.kv_group_size is None else args.kv_group_size
    return {"kv_bits": args.kv_bits, "kv_group_size": group}


def add_draft_flags(parser: argparse.ArgumentParser) -> None:
    """``--draft`` and ``--draft-depth``, shared by generate, chat and serve."""
    parser.add_argument(
        "--draft",
        choices=("ngram", "mtp", "off"),
        default="off",
        help="speculative decoding: prompt lookup (ngram), the checkpoint's multi-token-"
        "prediction head (mtp: qwen_gdn installs that carry mtp.* weights), or none (off, "
        "the default)",
    )
    parser.add_argument(
        "--draft-depth",
        type=int,
        default=None,
        help="the most tokens drafted per step (default: 4 for ngram, 2 for mtp)",
    )


def draft_policy(args: argparse.Namespace) -> DraftPolicies:
    """The policy ``--draft``/``--draft-depth`` name (a bad depth is refused by name)."""
    from turbospark.errors import InvalidInput
    from turbospark.policies import DraftPolicies

    if args.draft == "off":
        if args.draft_depth is not None:
            raise InvalidInput("--draft-depth sets the depth of a draft policy; add --draft ngram")
        return DraftPolicies.off()
    if args.draft_depth is None:
        return DraftPolicies.named(args.draft)
    if args.draft == "ngram":
        return DraftPolicies.ngram(max_draft=args.draft_depth)
    return DraftPolicies.mtp(depth=args.draft_depth)


def expert_slots(text: str) -> str:
    """``N``, ``auto`` or ``all`` for ``--expert-cache-slots`` (the policy is built
    in ``run``, so parsing the flag imports nothing heavy)."""
    word = text.strip().lower()
    if word in ("auto", "all") or (word.isdigit() and int(word) > 0):
        return word
    raise argparse.ArgumentTypeError(
        f"{text!r} is not an expert slot count: use a positive number of experts per layer, "
        "auto or all"
    )


def add_expert_cache_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--expert-cache-slots",
        type=expert_slots,
        default="all",
        metavar="N|auto|all",
        help="MoE models: routed experts kept resident per layer; the rest are read from the "
        "install when a token routes to them (at least top_k_experts; auto sizes it from free "
        "memory; default all: every expert resident)",
    )
