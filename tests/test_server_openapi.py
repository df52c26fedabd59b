"""``/openapi.json`` lists every route the app serves, with every method."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from serving import serving
from starlette.routing import Route

from turbospark.text import TextCodec

MODEL = "tiny-openapi"


def test_every_route_the_app_serves_is_documented(install: Path, codec: TextCodec) -> None:
    with serving(install, codec, slots=1) as server:
        reply = httpx.get(f"{server.base_url}/openapi.json")
        routes = [r for r in server.app.routes if isinstance(r, Route)]  # type: ignore[attr-defined]
    assert reply.status_code == 200
    paths = reply.json()["paths"]
    served = {
        (re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path), method.lower())
        for route in routes
        for method in route.methods or ()
        if method != "HEAD"
    }
    documented = {(path, method) for path, ops in paths.items() for method in ops}
    assert len(served) > 10
    assert served == documented, (served - documented, documented - served)
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/embeddings"):
        assert "requestBody" in paths[path]["post"], path
