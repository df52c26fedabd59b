"""Run under ``mlx.launch -n N``: the sharded model's logits against the unsharded
one's, on every rank, over a chunked prefill, single-token decodes and a
two-row batched decode. Writes ``{rank: max_abs_diff}`` as JSON to ``OUT.rank``.

Usage: ``mlx.launch -n 2 --backend ring -- python tests/distributed/logits.py INSTALL OUT``
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx.utils import tree_flatten

from turbospark import Runner

PROMPT = [(7 * i + 3) % 120 + 1 for i in range(40)]
REPLY = [5, 9, 17, 2]


def logits_of(runner: Runner) -> tuple[mx.array, int]:
    """Prefill in chunks of 16, decode REPLY, then decode two sessions batched.
    Also returns the first session's state bytes (sharded by head under a group)."""
    rows = [runner.prefill_chunk(PROMPT[:16], 0), runner.prefill_chunk(PROMPT[16:], 16)]
    for i, token in enumerate(REPLY):
        rows.append(runner.produce(token, len(PROMPT) + i))
    first = runner.checkout()
    runner.reset()
    rows.append(runner.prefill_chunk(PROMPT[:9], 0))
    second = runner.checkout()
    state = runner.merge_states([first, second])
    batched = runner.forward_batch(
        mx.array([[3], [4]]), [first.position, second.position], state
    )  # (2, vocab)
    nbytes = sum(component.nbytes for component in first.state.values())
    return mx.concatenate([mx.stack(rows), batched]), nbytes


def main() -> None:
    install, out = sys.argv[1], sys.argv[2]
    group = mx.distributed.init()
    sharded_runner, whole_runner = Runner.open(install, group=group), Runner.open(install)
    (sharded, sharded_bytes), (whole, whole_bytes) = (
        logits_of(sharded_runner),
        logits_of(whole_runner),
    )
    params = [
        sum(v.size for _, v in tree_flatten(r.model.parameters()))
        for r in (sharded_runner, whole_runner)
    ]
    diff = mx.abs(sharded - whole).max().item()
    scale = mx.abs(whole).max().item()
    with open(f"{out}.{group.rank()}", "w") as f:
        json.dump(
            {
                "rank": group.rank(),
                "size": group.size(),
                "diff": diff,
                "scale": scale,
                "params": params,  # [sharded, whole] on this rank
                "state_bytes": [sharded_bytes, whole_bytes],
            },
            f,
        )


if __name__ == "__main__":
    main()
