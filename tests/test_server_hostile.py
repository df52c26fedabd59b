"""Hostile input against a real server on loopback: no 5xx, nothing changed by a refusal.

The fuzzer is schemathesis over the server's own ``/openapi.json`` (generated
from the pydantic models it validates with): it is maintained, understands
OpenAPI, and generates both valid bodies and bodies that break the schema on
purpose (wrong types, missing and out-of-range fields). Hypothesis strategies
of our own add what a JSON Schema fuzzer cannot express: lone surrogates,
non-JSON bytes, NaN, integers past Python's digit limit, deep nesting.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import client, service, serving, sessions

from turbospark.server import ThreadedServer
from turbospark.text import TextCodec

MODEL = "tiny-hostile"
# A short context bounds every generation the fuzzer asks for (max_tokens may be huge).
CONTEXT = 256
FUZZ_EXAMPLES = int(os.environ.get("TURBOSPARK_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def server(install: Path, codec: TextCodec) -> Iterator[ThreadedServer]:
    with serving(install, codec, slots=2, context=CONTEXT) as running:
        # Give both sessions content, so a refusal that touched one would show.
        api = client(running)
        for text in ("A first conversation.", "Another one, entirely different."):
            api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=3
            )
        yield running


def post(server: ThreadedServer, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}{path}",
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=60,
    )


def assert_refused_cleanly(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]


def assert_keeps_serving(server: ThreadedServer) -> None:
    reply = client(server).completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert reply.choices[0].finish_reason in {"stop", "length"}


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SURROGATE = '"\\ud800"'  # JSON's escape for a lone UTF-16 surrogate


def chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


HOSTILE = [
    (COMPLETIONS, f'{{"model": "{MODEL}", "prompt": {SURROGATE}}}', "prompt"),
    (COMPLETIONS, f'{{"model": {SURROGATE}, "prompt": "a"}}', "model"),
    (CHAT, f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {SURROGATE}}}]}}',
     "messages.0.content"),
    (CHAT, f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": '
     f'[{{"type": "text", "text": "a\\udfff"}}]}}]}}', "messages.0.content.0.text"),
    (CHAT, json.dumps(chat())[:-1] + f', "stop": [{SURROGATE}]}}', "stop.0"),
    (CHAT, json.dumps(chat(seed=-1)), "seed"),
    (CHAT, json.dumps(chat(seed=2**64)), "seed"),
    (CHAT, json.dumps(chat())[:-1] + ', "temperature": NaN}', "temperature"),
    (CHAT, json.dumps(chat())[:-1] + ', "max_tokens": ' + "9" * 5000 + "}", None),
    (CHAT, "[" * 100_000 + "]" * 100_000, None),
    (CHAT, '{"model": "' + MODEL + '", "messages": ' + "[" * 5000 + "]" * 5000 + "}", None),
    (CHAT, "\xff\xfe{}", None),
    (CHAT, "", None),
    (CHAT, '"just a string"', None),
    (COMPLETIONS, json.dumps({"model": MODEL, "prompt": [[1, 2], "x"]}), "prompt"),
    (COMPLETIONS, json.dumps({"model": MODEL, "prompt": [10**30]}), "prompt"),
    (COMPLETIONS, json.dumps({"model": MODEL, "prompt": ["a"] * 17}), "prompt"),
    (COMPLETIONS, json.dumps({"model": MODEL, "prompt": ["a", [1]]}), "prompt"),
    (CHAT, json.dumps(chat(messages=[{"role": "robot", "content": "x"}])), "messages.0.role"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE)
def test_hostile_bodies_are_refused_without_touching_a_session(
    server: ThreadedServer, path: str, body: str, param: str | None
) -> None:
    before = sessions(server)
    response = post(server, path, body.encode("utf-8", "surrogateescape"))
    assert_refused_cleanly(response)
    if param is not None:
        assert (response.json()["error"]["param"] or "").startswith(param)
    assert sessions(server) == before
    assert_keeps_serving(server)


# -- the fuzzer ---------------------------------------------------------------------------


def _schema_cases(schema: schemathesis.BaseSchema, path: str) -> st.SearchStrategy[tuple]:
    """Valid bodies for our model (any other name is a 404 and goes no further)
    and bodies that break the schema on purpose."""
    operation = schema[path]["POST"]
    valid = operation.as_strategy(schemathesis.GenerationMode.POSITIVE).map(
        lambda case: (path, {**case.body, "model": MODEL})
    )
    broken = operation.as_strategy(schemathesis.GenerationMode.NEGATIVE)
    return valid | broken.map(lambda case: (path, case.body))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_SURROGATE_TEXT = st.text(max_size=10).flatmap(
    lambda s: st.integers(0xD800, 0xDFFF).map(lambda c: s + chr(c))
)


def _poisoned(body: dict[str, object]) -> st.SearchStrategy[tuple[str, object]]:
    """A valid body with one field replaced by a hostile value."""
    keys = [*body, "temperature", "top_p", "top_k", "seed", "stop", "n", "stream_options"]
    return st.tuples(st.sampled_from(keys), _JSON | _SURROGATE_TEXT | st.just(float("nan")))


def _hostile(path: str) -> st.SearchStrategy[tuple]:
    base = chat() if path == CHAT else {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    return _poisoned(base).map(lambda kv: (path, {**base, kv[0]: kv[1]}))


def _encode(body: object) -> bytes:
    if body is None or type(body).__name__ == "NotSet":
        return b""
    if isinstance(body, bytes):  # schemathesis' negative mode sends raw bytes too
        return body
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


# The schema fuzz is the biggest hypothesis run here: the full suite, not the inner loop.
@pytest.mark.slow
def test_fuzzing_the_published_schema_never_gets_a_5xx_or_changes_a_session_on_refusal(
    server: ThreadedServer,
) -> None:
    document = httpx.get(f"{server.base_url}/openapi.json").json()
    schema = schemathesis.openapi.from_dict(document)
    cases = st.one_of(
        _schema_cases(schema, CHAT),
        _schema_cases(schema, COMPLETIONS),
        _hostile(CHAT),
        _hostile(COMPLETIONS),
    )
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def one_request(case: tuple[str, object]) -> None:
        path, body = case
        before = sessions(server)
        response = post(server, path, _encode(body))
        outcomes[str(response.status_code)] += 1
        assert response.status_code < 500, response.text[:300]
        if response.status_code >= 400:
            assert_refused_cleanly(response)
            assert sessions(server) == before
        elif "text/event-stream" in response.headers["content-type"]:
            assert '"server_error"' not in response.text
            assert response.text.rstrip().endswith("data: [DONE]")

    one_request()
    print(f"fuzz outcomes over {FUZZ_EXAMPLES} examples: {dict(outcomes)}")
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert_keeps_serving(server)
    assert service(server).admission.active == 0
