"""Who may use the server: ``--api-key`` and ``--cors-origin``.

The key guards every route that reads or writes a conversation (``/v1/...``, Ollama's ``/api/...``
and the sessions view); ``/health``, ``/openapi.json`` and the page itself
stay open, so load balancers can probe and the page can load and ask for the
key. Clients send it as the OpenAI SDK does (``Authorization: Bearer KEY``) or
as the Anthropic SDK does (``x-api-key: KEY``). Cross-origin browsers are let
in by Starlette's own ``CORSMiddleware`` (a maintained, tested implementation
of the preflight rules), only from the origins named.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from turbospark.server.errors import APIError, error_response

GUARDED = ("/v1/", "/turbospark/", "/api/")


class ApiKeyMiddleware:
    """Refuse guarded routes without the key: 401, an error in the route's API
    shape (OpenAI's, or Anthropic's on ``/v1/messages``), and nothing reaches a
    handler (no session is touched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)  # CORS preflights carry no credentials
            return
        if not scope["path"].startswith(GUARDED) or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        refusal = APIError(
            401,
            "this server needs an API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
            code="invalid_api_key",
        )
        await error_response(refusal, scope["path"])(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        offered = headers.get(b"x-api-key", b"")
        authorization = headers.get(b"authorization", b"")
        if authorization[:7].lower() == b"bearer ":
            offered = authorization[7:].strip()
        return hmac.compare_digest(offered, self.key)


def access_middleware(api_key: str | None, cors_origins: Sequence[str]) -> list[Middleware]:
    """The middleware for these options, outermost first (CORS answers preflights)."""
    middleware: list[Middleware] = []
    if cors_origins:
        options: dict[str, Any] = {
            "allow_origins": list(cors_origins),
            "allow_methods": ["GET", "POST", "OPTIONS"],
            "allow_headers": ["Authorization", "Content-Type", "x-api-key"],
        }
        middleware.append(Middleware(CORSMiddleware, **options))
    if api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=api_key))
    return middleware
