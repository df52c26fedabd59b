"""Run under ``mlx.launch -n 2``: open each case's install with the group and
record the refusal every rank gets. Each case is ``NAME=RANK0_INSTALL,RANK1_INSTALL``,
optionally ``@SLOTS`` (``--expert-cache-slots`` for both ranks);
writes ``{name: message}`` as JSON to ``OUT.rank``. Cases run in order, and
every rank must refuse at the same point or the next case's collectives hang.

Usage: ``mlx.launch -n 2 --backend ring -- python tests/distributed/refusals.py OUT CASE...``
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx

from turbospark import Runner
from turbospark.errors import TurbosparkError
from turbospark.policies import ExpertCacheSlots


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    group = mx.distributed.init()
    refusals: dict[str, str | None] = {}
    for case in cases:
        name, installs = case.split("=", 1)
        installs, _, slots = installs.partition("@")
        install = installs.split(",")[group.rank()]
        try:
            experts = ExpertCacheSlots.parse(slots) if slots else None
            Runner.open(install, group=group, expert_cache=experts)
            refusals[name] = None
        except TurbosparkError as exc:
            refusals[name] = str(exc)
    with open(f"{out}.{group.rank()}", "w") as f:
        json.dump(refusals, f)


if __name__ == "__main__":
    main()
