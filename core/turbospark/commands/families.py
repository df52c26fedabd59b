"""``turbospark families``: the installed family plugins and their state components."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "families",
        help="list installed model families",
        description="List installed family plugins, their HF model types and state components "
        "with capabilities; broken plugins are listed with the reason.",
    )
    parser.add_argument(
        "installs",
        nargs="*",
        type=Path,
        metavar="INSTALL",
        help="also describe these installs or checkpoint directories (family, dtype, "
        "quantization), read from their manifest, config.json and safetensors header "
        "without loading weights",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(func=run)


def describe_install(path: Path) -> dict[str, Any]:
    """An install's (or a plain checkpoint directory's) family and packing, from
    its manifest, ``config.json`` and safetensors header alone: no tensor is read."""
    from turbospark.loading.checkpoint_config import read_config
    from turbospark.loading.convert import describe_block
    from turbospark.loading.importer import resolve_arch
    from turbospark.loading.install import MANIFEST, read_manifest, stored_quantized
    from turbospark.loading.plugins import default_registry
    from turbospark.loading.quantization import Quantization

    if (path / MANIFEST).is_file() or not (path / "config.json").is_file():
        manifest = read_manifest(path)  # refuses a directory that is neither, by name
        model_id, family, dtype = manifest.model_id, manifest.family, manifest.dtype
        kind = "install"
    else:
        kind = "checkpoint"
        config = read_config(path / "config.json")
        model_id, family = path.name, resolve_arch(config, None, default_registry()).family
        dtype = _header_dtype(path)
    block = Quantization.from_config(read_config(path / "config.json").model_dump())
    return {
        "path": str(path),
        "kind": kind,
        "model_id": model_id,
        "family": family,
        "dtype": dtype,
        "quantization": None if block is None else block.to_config(),
        "quantization_summary": describe_block(block, stored_quantized(path)),
    }


def _header_dtype(path: Path) -> str:
    """The compute dtype a checkpoint's shards give, as an open reads it
    (:func:`~turbospark.loading.sources.checkpoint_dtype`); ``unknown`` without shards."""
    from turbospark.loading.sources import checkpoint_dtype

    shards = sorted(f.name for f in path.glob("*.safetensors"))
    return checkpoint_dtype(path, shards) if shards else "unknown"


def run(args: argparse.Namespace) -> int:
    from turbospark.loading.plugins import default_registry

    registry = default_registry()
    families = [
        {
            "name": fam.name,
            "source": fam.source,
            "model_types": fam.spec.model_types,
            "state_source": fam.spec.state_source,
            "components": [c.model_dump() for c in fam.spec.components],
            # Sessions decode in one forward only when every component merges and
            # the family implements the batched forward; otherwise row by row.
            "batched_decode": all(c.batchable for c in fam.spec.components)
            and bool(fam.manager().hook.turbospark_forward_batch.get_hookimpls()),
            "steerable": fam.spec.steerable,
        }
        for fam in registry.families.values()
    ]
    broken = [{"name": b.name, "source": b.source, "error": b.error} for b in registry.broken]
    installs = [describe_install(path) for path in args.installs]
    if args.json:
        out: dict[str, Any] = {"families": families, "broken": broken}
        if args.installs:
            out["installs"] = installs
        print(json.dumps(out, indent=2))
        return 0
    if not families:
        print(registry.describe_installed())
    for fam in families:
        print(f"{fam['name']}  ({', '.join(fam['model_types'])})  from {fam['source']}")
        decode = "batched (one forward per step)" if fam["batched_decode"] else "row by row"
        print(f"    concurrent requests decode {decode}")
        steer = "yes (--steering)" if fam["steerable"] else "no (refused by name)"
        print(f"    activation steering: {steer}")
        for c in fam["components"]:
            rewind = {
                True: "rewindable",
                False: "not rewindable",
                "window": "rewindable within window",
            }
            flags = [
                "swappable" if c["swappable"] else "not swappable",
                rewind[c["rewindable"]],
                "persistable" if c["persistable"] else "not persistable",
                "batchable" if c["batchable"] else "not batchable",
            ]
            if c["traceable"]:
                flags.append("traceable (drafts roll back)")
            print(f"    {c['name']:<14} {', '.join(flags)}  — {c['description']}")
    for b in broken:
        print(f"BROKEN {b['name']} ({b['source']}): {b['error']}")
    for inst in installs:
        print(
            f"{inst['kind']} {inst['path']}: {inst['model_id']} ({inst['family']}, {inst['dtype']}, "
            f"{inst['quantization_summary']})"
        )
    return 0
