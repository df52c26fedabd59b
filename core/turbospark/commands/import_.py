"""``turbospark import HF_DIR OUT``: a Hugging Face checkpoint directory -> an install."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from turbospark.commands import add_quantize_flags, quantize_spec

# turbospark.loading.importer.DTYPES, written out so building the parser loads no MLX
# (tests/test_cli.py holds the two equal).
DTYPES = ("bfloat16", "float16", "float32")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "import",
        help="import a Hugging Face checkpoint directory as a turbospark install",
        description="Copy a Hugging Face checkpoint (config.json, safetensors shards, tokenizer "
        "files) into OUT, validated by its family, with every file's sha256 in manifest.json.",
    )
    parser.add_argument("hf_dir", type=Path, metavar="HF_DIR")
    parser.add_argument("out", type=Path, metavar="OUT", help="a new (or empty) directory")
    parser.add_argument("--dtype", choices=DTYPES, help="cast floating weights (default: keep)")
    parser.add_argument("--family", help="the family to use (default: found by model_type)")
    parser.add_argument("--model-id", help="the id served as `model` (default: HF_DIR's name)")
    add_quantize_flags(parser, "write the install so mlx-lm loads it too")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from turbospark.loading.checkpoint_config import read_config
    from turbospark.loading.convert import describe_block
    from turbospark.loading.importer import import_checkpoint
    from turbospark.loading.install import stored_quantized
    from turbospark.loading.quantization import Quantization

    spec = quantize_spec(args)
    manifest = import_checkpoint(
        args.hf_dir,
        args.out,
        dtype=args.dtype,
        family=args.family,
        model_id=args.model_id,
        quantize=spec,
        progress=not args.json,
    )
    size = sum(entry.size for entry in manifest.files.values())
    block = Quantization.from_config(read_config(args.out / "config.json").model_dump())
    if args.json:
        print(
            json.dumps(
                {
                    "model_id": manifest.model_id,
                    "family": manifest.family,
                    "dtype": manifest.dtype,
                    "files": len(manifest.files),
                    "bytes": size,
                    "out": str(args.out),
                    "quantization": None if block is None else block.to_config(),
                },
                indent=2,
            )
        )
        return 0
    packing = describe_block(block, stored_quantized(args.out))
    print(
        f"imported {manifest.model_id} ({manifest.family}, {manifest.dtype}, {packing}, "
        f"{len(manifest.files)} files, {size / 1e6:.1f} MB) into {args.out}"
    )
    return 0
