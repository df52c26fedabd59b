"""tinyllama's per-session state: one component, the attention K/V of every layer.

The core's :class:`~turbospark.state.kv.KVComponent` already implements the whole
state protocol (position, nbytes, rewind, snapshot/restore), so a plain
decoder declares it and is done: K/V keeps every token, so it rewinds without
limit, parks in a pool slot by reference, and snapshots to arrays.
"""

from __future__ import annotations

from turbospark.sdk import ComponentSpec, KVComponent, State

# The class declares what it can do (park, rewind, snapshot, batch); tinyllama
# writes no turbospark_forward_batch, so it does not claim to batch.
COMPONENTS = [
    ComponentSpec.of(
        KVComponent.CAPABILITIES, "kv", "keys/values of every attention layer", batchable=False
    ),
]


def new_state(num_layers: int) -> State:
    return {"kv": KVComponent(num_layers)}
