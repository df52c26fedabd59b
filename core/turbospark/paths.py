"""Where turbospark keeps what it builds and records on a machine: one root for every part."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$TURBOSPARK_CACHE``, else ``$XDG_CACHE_HOME/turbospark``, else ``~/.cache/turbospark``."""
    if explicit := os.environ.get("TURBOSPARK_CACHE"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "turbospark"
