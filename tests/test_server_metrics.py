"""``GET /metrics``: Prometheus counters, histogram and gauges after real requests,
parsed with prometheus-client's own parser; open without the API key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest
from mlx.utils import tree_flatten
from prometheus_client.parser import text_string_to_metric_families
from serving import client, serve_process, service, serving

from turbospark import build_synthetic_install
from turbospark.server import ThreadedServer
from turbospark.text import TextCodec, load_text

MODEL = "tiny-metrics"
KEY = "sekret"


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TextCodec]:
    path = tmp_path_factory.mktemp("metrics-gemma4")
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, sliding_window=8, model_id=MODEL
    )
    return path, load_text(path)


@pytest.fixture(scope="module")
def server(codec: tuple[Path, TextCodec]) -> Iterator[ThreadedServer]:
    with serving(codec[0], codec[1], slots=4, api_key=KEY) as running:
        yield running


def scrape(server: ThreadedServer | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    base = server if isinstance(server, str) else server.base_url
    reply = httpx.get(f"{base}/metrics", timeout=30)  # no key: open like /health
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


def test_metrics_count_requests_tokens_reuse_and_time(server: ThreadedServer) -> None:
    before = scrape(server)
    assert before[("turbospark_queue_depth", ())] == 0
    assert before[("turbospark_active_rows", ())] == 0
    assert before[("turbospark_batch_size", ())] == 0
    assert before[("turbospark_max_batch", ())] == 8
    assert before[("turbospark_evictions_total", ())] == 0

    sdk = client(server)
    sdk.api_key = KEY
    messages = [{"role": "user", "content": "Count the requests."}]
    chat = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    legacy = sdk.completions.create(model=MODEL, prompt="Count me too", max_tokens=3)
    refused = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": -1},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert refused.status_code == 400

    after = scrape(server)
    ok = (("endpoint", "chat.completions"), ("outcome", "ok"))
    assert after[("turbospark_requests_total", ok)] == 1
    ok = (("endpoint", "completions"), ("outcome", "ok"))
    assert after[("turbospark_requests_total", ok)] == 1
    bad = (("endpoint", "completions"), ("outcome", "refused"))
    assert after[("turbospark_requests_total", bad)] == 1

    assert chat.usage is not None and legacy.usage is not None
    prompt = chat.usage.prompt_tokens + legacy.usage.prompt_tokens
    completion = chat.usage.completion_tokens + legacy.usage.completion_tokens
    assert after[("turbospark_prompt_tokens_total", ())] == prompt
    assert after[("turbospark_completion_tokens_total", ())] == completion
    assert after[("turbospark_generations_total", (("outcome", "finished"),))] == 2
    reasons = {k[1]: v for k, v in after.items() if k[0] == "turbospark_reuse_total"}
    assert sum(reasons.values()) == 2
    assert all(label[0][0] == "reason" and label[0][1] for label in reasons)
    assert after[("turbospark_time_to_first_token_seconds_count", ())] == 2
    assert after[("turbospark_time_to_first_token_seconds_sum", ())] > 0
    inf = (("le", "+Inf"),)
    assert after[("turbospark_time_to_first_token_seconds_bucket", inf)] == 2
    # The engine's gauges are read at scrape time: idle again.
    assert after[("turbospark_active_rows", ())] == 0


def test_each_app_has_its_own_registry(
    server: ThreadedServer, codec: tuple[Path, TextCodec]
) -> None:
    with serving(codec[0], codec[1], slots=2) as other:
        fresh = scrape(other)
        key = (("endpoint", "chat.completions"), ("outcome", "ok"))
        assert ("turbospark_requests_total", key) not in fresh
        assert fresh[("turbospark_prompt_tokens_total", ())] == 0


MLX_MEMORY = (
    "turbospark_mlx_active_bytes",
    "turbospark_mlx_cache_bytes",
    "turbospark_mlx_peak_bytes",
)


def test_metrics_show_mlx_memory_as_mlx_reads_it(server: ThreadedServer) -> None:
    """The gauges are MLX's allocator read at scrape time: on an idle server (in
    this process) the same numbers as reading MLX directly, the weights among
    the active bytes."""
    sdk = client(server)
    sdk.api_key = KEY
    messages = [{"role": "user", "content": "Use some memory."}]
    sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    scraped = scrape(server)
    active, cache, peak = (scraped[(name, ())] for name in MLX_MEMORY)
    assert (active, cache, peak) == (
        mx.get_active_memory(),
        mx.get_cache_memory(),
        mx.get_peak_memory(),
    )
    model = service(server).runner.model
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    assert active >= weights > 0
    assert peak >= active


@pytest.mark.slow
def test_serve_mlx_cache_limit_bounds_the_cache_it_shows(codec: tuple[Path, TextCodec]) -> None:
    """``turbospark serve --mlx-cache-limit 0`` keeps no freed buffers, where the same
    requests on MLX's own bound leave some cached: the flag reaches the server's MLX,
    and /metrics shows it."""
    messages = [{"role": "user", "content": "Fill the buffer cache, then show it."}]
    cached = {}
    for flags in [(), ("--mlx-cache-limit", "0")]:
        with serve_process(codec[0], "--no-warm-up", *flags) as (_, base):
            sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            for _ in range(2):
                sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
            scraped = scrape(base)
            assert scraped[("turbospark_mlx_active_bytes", ())] > 0
            cached[flags] = scraped[("turbospark_mlx_cache_bytes", ())]
    assert cached[()] > 0
    assert cached[("--mlx-cache-limit", "0")] == 0
