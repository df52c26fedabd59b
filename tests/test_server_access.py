"""``--api-key`` and ``--cors-origin``: who may use the server, tested with the real clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from serving import serving

from turbospark.server import ThreadedServer
from turbospark.text import TextCodec

MODEL = "tiny-access"
KEY = "s3cret-key"
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def server(install: Path, codec: TextCodec) -> Iterator[ThreadedServer]:
    with serving(install, codec, 2, api_key=KEY, cors_origins=[ORIGIN]) as running:
        yield running


def test_the_key_is_required_and_a_refusal_touches_no_session(server: ThreadedServer) -> None:
    service = server.service  # type: ignore[attr-defined]
    before = service.engine.call(service.runner.session_nbytes).result()
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="needs an API key"):
        bad.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    for path in ("/v1/models", "/turbospark/sessions"):
        reply = httpx.get(f"{server.base_url}{path}")
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert service.engine.call(service.runner.session_nbytes).result() == before
    good = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hello", max_tokens=3).choices
    sessions = httpx.get(f"{server.base_url}/turbospark/sessions", headers={"x-api-key": KEY})
    assert sessions.status_code == 200


def test_health_and_the_page_stay_open(server: ThreadedServer) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    page = httpx.get(f"{server.base_url}/")
    assert page.status_code == 200 and "API key" in page.text


def test_cors_lets_the_named_origin_in_and_no_other(server: ThreadedServer) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(
            f"{server.base_url}/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )

    allowed = preflight(ORIGIN)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    refused = preflight("https://evil.example.com")
    assert "access-control-allow-origin" not in refused.headers


def test_anthropic_routes_refuse_in_anthropic_shape(server: ThreadedServer) -> None:
    """A 401 (and any other refusal) on /v1/messages is Anthropic's error body,
    so the anthropic SDK raises its own classes; no session is touched."""
    service = server.service  # type: ignore[attr-defined]
    before = service.engine.call(service.runner.session_nbytes).result()
    ask = [{"role": "user", "content": "hi"}]
    bad = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError, match="needs an API key") as raised:
        bad.messages.create(model=MODEL, messages=ask, max_tokens=3)
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": raised.value.body["error"]["message"]},
    }
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model=MODEL, messages=ask)
    assert service.engine.call(service.runner.session_nbytes).result() == before
    good = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError, match="nope"):
        good.messages.create(model="nope", messages=ask, max_tokens=3)
    wrong_method = httpx.get(f"{server.base_url}/v1/messages", headers={"x-api-key": KEY})
    assert wrong_method.status_code == 405
    assert wrong_method.json()["type"] == "error"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert good.messages.count_tokens(model=MODEL, messages=ask).input_tokens > 0
