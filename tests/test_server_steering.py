"""Steering per request and per batch row: the engine with rows under different
settings, and a real server on loopback driven by the OpenAI SDK with the
``"turbospark": {"steering": ...}`` extension."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_engine import CONTEXT, Collector, run_all
from test_steering import random_directions, write_gguf

from turbospark import build_synthetic_install
from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.policies.steering import SteeringPolicy
from turbospark.server import ThreadedServer, create_app
from turbospark.server.worker import RunnerWorker
from turbospark.text import TextCodec, load_text

MODEL = "tiny-steer"
PROMPTS = [[2, 5, 9, 14, 20, 31, 40], [2, 5, 9, 60, 61], [2, 70, 71, 72, 73, 74, 75, 76, 77]]


@pytest.fixture(scope="module", params=["gemma4", "qwen_gdn"])
def install(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"steer-{request.param}")
    build_synthetic_install(request.param, path, vocab_size=128, num_layers=3, model_id=MODEL)
    return path


@pytest.fixture(scope="module")
def vector(install: Path) -> Path:
    runner = Runner.open(install)
    return write_gguf(
        install.parent / f"{install.name}.gguf",
        {k: 6 * v for k, v in random_directions([1, 2], 11, runner.arch.hidden_size).items()},
    )


def test_batched_rows_under_different_steering_equal_each_alone(install: Path, vector: Path):
    """Three requests decoded together (steered, unsteered, clamped): each equals
    the same request run alone on a runner with that setting."""
    codec = load_text(install)
    served = SteeringPolicy.from_gguf(vector)
    settings = [None, SteeringPolicy.off(), served.with_settings(scale=0.5, mode="clamp")]
    runner = Runner.open(install, context_length=CONTEXT, session_slots=4, steering=served)
    runner.set_prefix_reuse(True)
    engine = Engine(runner, codec, max_batch=3)
    configs = [
        GenerationConfig(max_tokens=8, temperature=0.0, stop_token_ids=[], steering=s)
        for s in settings
    ]
    jobs = [Job(ids=p, config=c, emit=Collector()) for p, c in zip(PROMPTS, configs, strict=True)]
    run_all(engine, [(0, job) for job in jobs])
    assert all(job.emit.error is None for job in jobs)
    assert max(job.emit.chunks[-1].stats.batch_size for job in jobs) == 3
    for job, prompt, setting, config in zip(jobs, PROMPTS, settings, configs, strict=True):
        lone = Runner.open(install, context_length=CONTEXT, steering=setting or served)
        assert job.emit.tokens == generate(lone, codec, prompt, config).tokens
    unsteered = generate(Runner.open(install), codec, PROMPTS[0], configs[0]).tokens
    assert jobs[0].emit.tokens != unsteered  # the vector is strong enough to matter


@pytest.fixture(scope="module")
def server(install: Path, vector: Path) -> Iterator[ThreadedServer]:
    worker = RunnerWorker()

    def open_runner() -> Runner:
        runner = Runner.open(
            install,
            context_length=CONTEXT,
            session_slots=3,
            steering=SteeringPolicy.from_gguf(vector),
        )
        runner.set_prefix_reuse(True)
        return runner

    app = create_app(worker.run(open_runner), load_text(install), worker=worker, max_batch=3)
    with ThreadedServer(app) as running:
        yield running


def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def complete(server: ThreadedServer, prompt: list[int], steering: dict | None = None):
    extra = None if steering is None else {"turbospark": {"steering": steering}}
    return client(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra
    )


def test_a_request_overrides_the_served_steering(server: ThreadedServer, codec: TextCodec):
    """Scale 0 answers exactly as steering off; the served vector answers
    otherwise; the same prompt under another setting is never reused."""
    prompt = [3, 8, 13, 21, 34, 55]
    off = complete(server, prompt, {"mode": "off"})
    zero = complete(server, prompt, {"scale": 0.0})
    assert zero.choices[0].text == off.choices[0].text
    assert zero.usage.model_extra["turbospark"]["reuse_reason"] == "steering_changed"
    served = complete(server, prompt)
    assert served.usage.model_extra["turbospark"]["reuse_reason"] == "steering_changed"
    again = complete(server, prompt, {"mode": "off"})  # its parked session is found again
    assert again.usage.model_extra["turbospark"]["reuse_reason"] != "steering_changed"
    assert again.choices[0].text == off.choices[0].text


@pytest.mark.parametrize(
    ("steering", "message"),
    [
        ({"mode": "sideways"}, "mode"),
        ({"layers": "1:9"}, "outside the model"),
        ({"layers": "3-4"}, "layers"),
        ({"scale": "loud"}, "scale"),
        ({"gain": 2}, "gain"),
    ],
)
def test_a_bad_override_is_a_400_naming_it(server: ThreadedServer, steering, message):
    with pytest.raises(openai.BadRequestError, match=message) as refused:
        complete(server, [1, 2, 3], steering)
    assert refused.value.status_code == 400


def test_a_non_finite_scale_is_a_400(server: ThreadedServer) -> None:
    """1e400 parses as infinity (the SDK cannot even send it): refused by name."""
    body = '{"model": "%s", "prompt": [1, 2], "turbospark": {"steering": {"scale": 1e400}}}'
    reply = httpx.post(f"{server.base_url}/v1/completions", content=body % MODEL)
    assert reply.status_code == 400
    assert "turbospark.steering.scale" in reply.json()["error"]["message"]


@pytest.fixture(scope="module")
def codec(install: Path) -> TextCodec:
    return load_text(install)


def test_an_override_without_a_served_vector_is_refused(install: Path) -> None:
    worker = RunnerWorker()
    app = create_app(worker.run(lambda: Runner.open(install)), load_text(install), worker=worker)
    with ThreadedServer(app) as running, pytest.raises(openai.BadRequestError, match="--steering"):
        complete(running, [1, 2, 3], {"scale": 0.5})


@pytest.mark.parametrize(
    ("route", "body", "shape"),
    [
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, "anthropic"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 4}, "openai"),
    ],
)  # fmt: skip
def test_the_override_reaches_the_messages_and_responses_routes(server, route, body, shape):
    """Not ignored there either: a bad override is the same 400, a good one serves."""
    model = client(server).models.list().data[0].id
    bad = {**body, "model": model, "turbospark": {"steering": {"mode": "sideways"}}}
    reply = httpx.post(f"{server.base_url}{route}", json=bad, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "mode" in error["message"]
    assert (error["type"] == "invalid_request_error") if shape == "anthropic" else True
    good = {**body, "model": model, "turbospark": {"steering": {"mode": "off"}}, "draft": "off"}
    assert httpx.post(f"{server.base_url}{route}", json=good, timeout=60).status_code == 200
