"""``turbospark families``: the installed family plugins and their state components."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "families",
        help="list installed model families",
        description="List installed family plugins, their HF model types and state components "
        "with capabilities; broken plugins are listed with the reason.",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(func=run)


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
    if args.json:
        print(json.dumps({"families": families, "broken": broken}, indent=2))
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
    return 0
