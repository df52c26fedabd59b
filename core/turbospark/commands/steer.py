"""``turbospark steer extract``: a control vector from contrastive prompts; and the
``--steering`` flags ``generate``, ``chat`` and ``serve`` share.

The vector is written in llama.cpp's control-vector format, so the same file
steers llama.cpp (``--control-vector``) and turbospark (``--steering``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from turbospark.commands import MODEL_HELP, model_text

if TYPE_CHECKING:  # MLX loads in run(), so `turbospark --help` stays light
    from turbospark.policies.steering import SteeringPolicy

MODES = ["add", "ablate", "clamp", "renorm"]


def add_steering_args(parser: argparse.ArgumentParser) -> None:
    """The steering flags, as the original runtime (and llama.cpp) spell them."""
    parser.add_argument(
        "--steering",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a llama.cpp control-vector GGUF (repeatable: the vectors are summed)",
    )
    # Free text, checked by SteeringPolicy: a bad mode is refused in its own one line.
    parser.add_argument("--steering-mode", default="add", help=f"one of {', '.join(MODES)}")
    parser.add_argument("--steering-scale", type=float, default=1.0, help="s (default 1.0)")
    parser.add_argument(
        "--steering-layers",
        default=None,
        metavar="S:E",
        help="inclusive layer range, numbered as llama.cpp's direction.N (default: all)",
    )


def steering_policy(args: argparse.Namespace) -> SteeringPolicy | None:
    """The flags as a policy (None without ``--steering``), checked before weights load."""
    from turbospark.errors import InvalidInput
    from turbospark.policies.steering import SteeringPolicy

    if not args.steering:
        tuned = args.steering_layers is not None or args.steering_scale != 1.0
        if tuned or args.steering_mode != "add":
            raise InvalidInput("--steering-mode/-scale/-layers need a vector: add --steering FILE")
        return None
    return SteeringPolicy.from_gguf(
        args.steering, args.steering_scale, args.steering_mode, args.steering_layers
    )


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "steer",
        help="make activation-steering vectors",
        description="Make activation-steering vectors in llama.cpp's control-vector format.",
    )
    actions = parser.add_subparsers(dest="steer_command", metavar="ACTION", required=True)
    extract = actions.add_parser(
        "extract",
        help="a control vector from contrastive prompt pairs (repeng's method)",
        description="Run every positive and negative prompt (one per line, paired line by "
        "line) through MODEL, keep the last token's hidden state at each layer's output, and "
        "write per layer the difference of the means (mean) or the first principal component "
        "of the paired differences, signed so positives project higher (pca). The output is "
        "llama.cpp's control-vector GGUF.",
    )
    extract.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    extract.add_argument("--positive", type=Path, required=True, metavar="FILE")
    extract.add_argument("--negative", type=Path, required=True, metavar="FILE")
    extract.add_argument("--out", type=Path, required=True, metavar="VEC.gguf")
    extract.add_argument("--layers", default=None, metavar="S:E", help="default: every layer")
    extract.add_argument("--method", choices=["mean", "pca"], default="mean")
    extract.add_argument("--raw", action="store_true", help="skip the chat template")
    extract.add_argument("--json", action="store_true", help="print one JSON object at the end")
    extract.set_defaults(func=run_extract)


def run_extract(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from turbospark.commands import prompt_ids
    from turbospark.errors import InvalidInput
    from turbospark.generation.runner import Runner
    from turbospark.policies.control_vectors import (
        directions_from_states,
        read_prompts,
        write_control_vector,
    )
    from turbospark.policies.steering import parse_layers

    source, codec = model_text(args.model)
    positive, negative = read_prompts(args.positive), read_prompts(args.negative)
    if len(positive) != len(negative):
        raise InvalidInput(
            f"{args.positive} has {len(positive)} prompts and {args.negative} {len(negative)}; "
            "they are paired line by line, so give both the same number"
        )
    if args.method == "pca" and len(positive) < 2:
        raise InvalidInput("--method pca needs at least 2 prompt pairs; add pairs or use mean")
    span = parse_layers(args.layers)
    runner = Runner.open(source)
    top = runner.arch.num_hidden_layers - 1
    low, high = span or (1, top)
    if high > top:
        raise InvalidInput(f"--layers {low}:{high} is outside the model; its layers are 1..{top}")
    states: dict[str, list[dict[int, np.ndarray]]] = {"positive": [], "negative": []}
    prompts = [("positive", p) for p in positive] + [("negative", n) for n in negative]
    for side, prompt in tqdm(prompts, desc="prompts", unit="prompt", disable=args.json):
        outputs = runner.layer_outputs(prompt_ids(codec, prompt, args.raw))
        states[side].append(
            {k: np.array(v, dtype=np.float32) for k, v in outputs.items() if low <= k <= high}
        )
    directions = directions_from_states(states["positive"], states["negative"], args.method)
    write_control_vector(args.out, directions, runner.arch.model_type)
    summary = {
        "out": str(args.out),
        "method": args.method,
        "pairs": len(positive),
        "layers": [low, high],
        "hidden_size": runner.arch.hidden_size,
        "norms": {k: round(float(np.linalg.norm(v)), 6) for k, v in directions.items()},
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"wrote {args.out}: {len(directions)} layer(s) {low}..{high}, {args.method} of "
            f"{len(positive)} pair(s); use it with --steering {args.out}",
            file=sys.stderr,
        )
    return 0
