"""Core's own hook implementations: defaults every family gets and may override.

Registered beside the family plugin in each runner's manager, ``trylast`` so a
family's own implementation (``firstresult``) wins when it has one.
"""

from __future__ import annotations

from turbospark.contract.hookspecs import hookimpl
from turbospark.state.components import Snapshot, State


@hookimpl(trylast=True)
def turbospark_snapshot_state(state: State) -> dict[str, Snapshot]:
    return {name: component.snapshot() for name, component in state.items()}


@hookimpl(trylast=True)
def turbospark_restore_state(state: State, snapshot: dict[str, Snapshot]) -> bool:
    missing = sorted(set(state) - set(snapshot))
    if missing:
        raise ValueError(f"snapshot lacks component(s) {', '.join(missing)}")
    for name, component in state.items():
        component.restore(snapshot[name])
    return True
