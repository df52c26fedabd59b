"""The OpenAI-compatible server: :func:`create_app` and :class:`ThreadedServer`.

Both load on first use, so importing a light submodule (``settings``, which the
CLI reads for its defaults) does not start the web stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from turbospark.server.app import create_app
    from turbospark.server.background import ThreadedServer

__all__ = ["ThreadedServer", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from turbospark.server.app import create_app

        return create_app
    if name == "ThreadedServer":
        from turbospark.server.background import ThreadedServer

        return ThreadedServer
    raise AttributeError(f"module 'turbospark.server' has no attribute {name!r}")
