"""The OpenAI-compatible server: :func:`create_app` and :class:`ThreadedServer`."""

from turbospark.server.app import create_app
from turbospark.server.background import ThreadedServer

__all__ = ["ThreadedServer", "create_app"]
