"""Per-session state: the component protocols (``components.py``) and attention K/V (``kv.py``).

``turbospark.state`` was one module before the layout had parts; its names are
served here, with a DeprecationWarning, for one SDK minor version.
"""

from __future__ import annotations

import importlib
from typing import Any

_OLD = {
    **dict.fromkeys(
        [
            "StateComponent",
            "State",
            "Snapshot",
            "LayerPart",
            "LayeredComponent",
            "state_position",
            "state_nbytes",
            "refuse_rewind",
        ],
        "turbospark.state.components",
    ),
    **dict.fromkeys(["LayerKV", "KVComponent"], "turbospark.state.kv"),
}


def __getattr__(name: str) -> Any:
    if name not in _OLD:
        raise AttributeError(f"module 'turbospark.state' has no attribute {name!r}")
    from turbospark._moved import warn

    warn(f"turbospark.state.{name}", f"{_OLD[name]}.{name}")
    return getattr(importlib.import_module(_OLD[name]), name)
