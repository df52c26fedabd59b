"""Saying *what* leaked when a check fails: which component, which session.

A logits mismatch only says that something is wrong. These helpers look at
the sessions a runner holds and name the culprit: a component object shared
by two sessions (parking one changes the other), a mutable object or array
shared anywhere below two fresh states' components (found by walking them),
a component whose contents differ from a fresh run of the conversation it
is supposed to hold, down to the entry and the first differing index, or
state kept on the model object itself (what it holds that a freshly loaded
model does not).
The runner's sessions are read here and only here (the kit ships in the
core, beside the runner it inspects).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from types import FunctionType, MethodType, ModuleType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from pydantic import BaseModel

from turbospark.state.components import State

if TYPE_CHECKING:
    from turbospark.contract.hookspecs import ComponentSpec
    from turbospark.generation.runner import Runner


class Reference(Protocol):
    """What a diagnosis compares against (the kit's :class:`~turbospark.conformance.kit.FamilyKit`):
    the family's component specs, its tolerances, and a fresh state for a history."""

    atol: float
    rtol: float

    def component(self, name: str) -> ComponentSpec: ...

    def fresh_state(self, history: Sequence[int]) -> State: ...

    def model_changes(self, model: Any) -> list[str]: ...


def fail(message: str) -> NoReturn:
    __tracebackhide__ = True  # pytest shows the check's line, not this one
    raise AssertionError(message)


def live_state(runner: Runner) -> State:
    return runner.session_states()[0]


def session_states(runner: Runner) -> list[tuple[str, State]]:
    """``(label, state)`` for the live session and every parked slot."""
    live, *parked = runner.session_states()
    return [("the live session", live), *((f"parked slot {i}", s) for i, s in enumerate(parked))]


def shared_components(sessions: Sequence[tuple[str, State]]) -> list[str]:
    """One line per component object that two sessions hold at once."""
    seen: dict[int, tuple[str, str]] = {}
    found = []
    for label, state in sessions:
        for name, component in state.items():
            key = id(component)
            if key in seen:
                first_label, first_name = seen[key]
                found.append(
                    f"component '{name}' of {label} is the same object as component "
                    f"'{first_name}' of {first_label}: parking one session changes the other"
                )
            else:
                seen[key] = (label, name)
    return found


CONTAINERS = (mx.array, np.ndarray, list, dict, set, bytearray)
CODE = (type, Enum, FunctionType, MethodType, ModuleType)
OPAQUE = (*CODE, nn.Module)
WALK_DEPTH = 8


def is_mutable(value: Any) -> bool:
    """Arrays, mutable containers and instances with attributes; not the model,
    classes, functions, enums, frozen pydantic models, or attribute-less
    singletons such as ``mx.float32``."""
    if isinstance(value, OPAQUE):
        return False
    if isinstance(value, BaseModel) and value.model_config.get("frozen", False):
        return False
    return isinstance(value, CONTAINERS) or hasattr(value, "__dict__") or bool(_slots(value))


def walk_state(state: State, visit: Callable[[str, Any], bool]) -> None:
    """Call ``visit(path, obj)`` on every mutable object and array below *state*'s
    components (``state['kv'].layers[0].keys``), descending into an object only
    when *visit* returns True. Arrays count as mutable: ``a[...] = x`` writes
    them in place. The model (an ``nn.Module``) is shared by design and skipped
    (see :func:`is_mutable`); tuples are walked through but not reported."""
    seen: set[int] = set()

    def walk(value: Any, path: str, depth: int) -> None:
        walked = isinstance(value, tuple | frozenset)  # walked through, never reported
        if not (walked or is_mutable(value)) or id(value) in seen:
            return
        seen.add(id(value))
        if not walked and not visit(path, value):
            return
        if isinstance(value, mx.array | np.ndarray) or depth >= WALK_DEPTH:
            return
        if isinstance(value, dict):
            items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
        elif isinstance(value, list | tuple | set | frozenset):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            attrs = dict(getattr(value, "__dict__", {}))
            attrs.update({k: getattr(value, k) for k in _slots(value) if hasattr(value, k)})
            items = [(f"{path}.{k}", v) for k, v in attrs.items()]
        for child_path, child in items:
            walk(child, child_path, depth + 1)

    for name, component in state.items():
        walk(component, f"state[{name!r}]", 0)


def _slots(value: Any) -> list[str]:
    return [s for cls in type(value).__mro__ for s in getattr(cls, "__slots__", ())]


def shared_below(first: tuple[str, State], second: tuple[str, State]) -> list[str]:
    """One line per mutable object or array that two states both hold, anywhere
    below their components, naming where it sits in each (the shallowest place:
    a shared list is reported once, not once per element)."""
    (first_label, first_state), (second_label, second_state) = first, second
    places: dict[int, str] = {}

    def record(path: str, value: Any) -> bool:
        places[id(value)] = path
        return True

    walk_state(first_state, record)
    found = []

    def compare(path: str, value: Any) -> bool:
        if id(value) not in places:
            return True
        component = path.split("'")[1]
        found.append(
            f"component '{component}' of {second_label} holds {path} "
            f"({type(value).__name__}), the same object as {first_label}'s "
            f"{places[id(value)]}: a write through one reaches the other"
        )
        return False

    walk_state(second_state, compare)
    return found


def first_difference(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> str:
    """Where two same-shaped arrays first differ: ``index (0, 1, 249, 3)``."""
    bad = ~np.isclose(a, b, atol=atol, rtol=rtol)
    return f"first at index {tuple(int(i) for i in np.argwhere(bad)[0])}" if bad.any() else ""


def ring_tails(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows two ring buffers both hold (aligned at the newest), when their
    shapes differ along one axis only; else None."""
    axes = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=False)) if x != y]
    if a.ndim != b.ndim or len(axes) != 1:
        return None
    n = min(a.shape[axes[0]], b.shape[axes[0]])
    tail = [slice(None)] * a.ndim
    tail[axes[0]] = slice(-n, None) if n else slice(0, 0)
    return a[tuple(tail)], b[tuple(tail)]


def component_differences(
    kit: Reference, state: State, reference: State, against: str = "a fresh run"
) -> list[str]:
    """One line per component of *state* that differs from *reference* (which
    the lines call *against*): position,
    then (for persistable components) the snapshot's keys, shapes and values,
    with the first index that differs. A sliding-window component (declared
    ``rewindable="window"``) may hold fewer rows than a fresh run: only the rows
    both hold are compared, and its scalar entries (a ring's offset) are not."""
    found = []
    for name, component in state.items():
        ref = reference[name]
        if component.position != ref.position:
            found.append(
                f"component '{name}' is at position {component.position}, {against} is at "
                f"{ref.position}"
            )
            continue
        if not kit.component(name).persistable:
            continue
        ring = kit.component(name).rewindable == "window"
        ours, theirs = component.snapshot(), ref.snapshot()
        if set(ours) != set(theirs):
            odd = sorted(set(ours) ^ set(theirs))
            found.append(
                f"component '{name}' has snapshot entries {against} lacks: {', '.join(odd)}"
            )
            continue
        for key in sorted(ours):
            a, b = np.asarray(ours[key]), np.asarray(theirs[key])
            tails = ring_tails(a, b) if ring else None
            if ring and a.ndim == 0:
                continue
            if tails is not None:
                a, b = tails
            elif a.shape != b.shape:
                found.append(
                    f"component '{name}' entry '{key}' has shape {a.shape}, {against} {b.shape}"
                )
                continue
            if a.ndim == 0 and not np.allclose(a, b, atol=kit.atol, rtol=kit.rtol):
                found.append(
                    f"component '{name}' entry '{key}' is {a.item()}, {against} {b.item()}"
                )
            elif not np.allclose(a, b, atol=kit.atol, rtol=kit.rtol):
                gap = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                where = first_difference(a, b, kit.atol, kit.rtol)
                rows = " (in the rows both hold)" if tails is not None else ""
                found.append(
                    f"component '{name}' entry '{key}' differs from {against}{rows} by up to "
                    f"{gap:.3g}, {where}"
                )
    return found


def explain_session(
    kit: Reference, runner: Runner, conversation: str, history: Sequence[int]
) -> str:
    """Why the live session, which should hold *conversation*, does not."""
    lines = shared_components(session_states(runner))
    lines += [
        f"{line} (in the live session, holding {conversation})"
        for line in component_differences(kit, live_state(runner), kit.fresh_state(history))
    ]
    if not lines:
        lines = [no_component_differs(kit, runner.model)]
    return "\n  - " + "\n  - ".join(lines)


def no_component_differs(kit: Reference, model: Any) -> str:
    """The verdict when every component equals its reference: state kept on the
    model, if the model holds something a fresh load does not, else the forward."""
    changes = kit.model_changes(model)
    if changes:
        return (
            "no component differs from a fresh run, but the model object holds state a freshly "
            "loaded one does not (every session shares it; keep it in a state component): "
            + "; ".join(changes)
        )
    return "no component differs from a fresh run: the forward itself diverged"


SCALARS = (int, float, str, bytes, bool, type(None))
SHOWN_CHANGES = 4


def model_fingerprint(model: nn.Module) -> dict[str, str]:
    """``path -> description`` of everything below *model*: each array's shape
    and dtype, each container's length, each scalar's value, each object's
    type. Two loads of one install print the same; a model that keeps a
    cache, a counter or a list of tokens on itself prints differently."""
    found: dict[str, str] = {}
    seen: set[int] = set()

    def walk(value: Any, path: str, depth: int) -> None:
        if isinstance(value, mx.array | np.ndarray):
            found[path] = f"array {tuple(value.shape)} {value.dtype}"
            return
        if isinstance(value, SCALARS):
            found[path] = repr(value)[:60]
            return
        if isinstance(value, CODE) or id(value) in seen or depth >= WALK_DEPTH:
            return
        seen.add(id(value))
        if isinstance(value, dict):  # nn.Module is one: its parameters and children
            found[path] = f"{type(value).__name__} of {len(value)}"
            items = [(f"{path}.{k}" if isinstance(value, nn.Module) else f"{path}[{k!r}]", v)
                     for k, v in value.items()]  # fmt: skip
        elif isinstance(value, list | tuple | set | frozenset):
            found[path] = f"{type(value).__name__} of {len(value)}"
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            found[path] = type(value).__name__
            items = []
        attrs = dict(getattr(value, "__dict__", {}))
        attrs.update({k: getattr(value, k) for k in _slots(value) if hasattr(value, k)})
        items += [(f"{path}.{k}", v) for k, v in attrs.items()]
        for child_path, child in items:
            walk(child, child_path, depth + 1)

    walk(model, "model", 0)
    return found


def fingerprint_changes(loaded: dict[str, str], now: dict[str, str]) -> list[str]:
    """What *now* holds that differs from *loaded* (the first few, shallowest first)."""
    paths = sorted(set(loaded) | set(now), key=lambda p: (p.count(".") + p.count("["), p))
    changed: list[str] = []
    shown: list[str] = []
    for path in paths:
        if loaded.get(path) == now.get(path) or any(path.startswith(p) for p in shown):
            continue  # what lies below a changed container is that change
        shown.append(path)
        changed.append(
            f"{path} is {now.get(path, 'gone')} (a new model: {loaded.get(path, 'absent')})"
        )
    more = len(changed) - SHOWN_CHANGES
    return changed[:SHOWN_CHANGES] + ([f"{more} more"] if more > 0 else [])
