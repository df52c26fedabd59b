"""``GET /metrics``: the server's numbers in Prometheus' text format.

Built on ``prometheus-client`` with a registry of the app's own (not the
library's global one), so several apps in one process never share counters.
Counters move where things happen: the HTTP handlers count requests by
endpoint and outcome, and the engine's observer (called on the runner thread
as each request ends) counts tokens and reuse reasons and times the first
token. Gauges (queue depth, active rows, batch size) and the eviction counts
are read from the engine at scrape time by a collector, and MLX's memory
(active, its buffer cache, the peak) from MLX's allocator by another.

The route stays open under ``--api-key`` as ``/health`` does (``access.py``
guards ``/v1/`` and ``/turbospark/`` only): it shows counts, never text.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterator

import mlx.core as mx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from turbospark.generation.engine import Engine, Job
from turbospark.generation.generate import GenerationStats
from turbospark.server.errors import APIError, ClientGone
from turbospark.server.response_store import ResponseStore
from turbospark.server.service import EventStream

Handler = Callable[[Request], Awaitable[Response]]

# Seconds from arrival to the first token: loopback-fast to a long queue wait.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    """What the engine holds now, read when Prometheus scrapes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield GaugeMetricFamily(
            "turbospark_queue_depth", "Requests waiting for a batch row.", engine.queue_depth
        )
        yield GaugeMetricFamily(
            "turbospark_active_rows",
            "Requests holding a session now (prefilling or decoding).",
            engine.active_rows,
        )
        yield GaugeMetricFamily(
            "turbospark_batch_size",
            "Rows decoding together in the merged batched state now.",
            engine.batch_size,
        )
        yield GaugeMetricFamily(
            "turbospark_max_batch", "The most requests that decode together.", engine.max_batch
        )
        yield CounterMetricFamily(
            "turbospark_evictions",
            "Requests that discarded a parked session with content.",
            engine.evictions,
        )
        yield CounterMetricFamily(
            "turbospark_session_disk_evictions",
            "Session files deleted to fit --max-session-disk that were their conversation's "
            "only copy (files of sessions still in memory go first and are not counted).",
            engine.runner.disk_losses,
        )
        yield from _expert_cache_metrics(engine)


class ResponseStoreCollector(Collector):
    """The stored Responses API responses (``response_store.py``), read at scrape time."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "turbospark_stored_responses",
            "Responses stored for previous_response_id.",
            len(self.store),
        )
        yield GaugeMetricFamily(
            "turbospark_stored_response_bytes",
            "Bytes the stored responses' items hold (bounded by --response-store-memory).",
            self.store.nbytes,
        )
        yield CounterMetricFamily(
            "turbospark_stored_response_evictions",
            "Stored responses evicted by --max-stored-responses, --response-store-memory or "
            "--response-ttl.",
            self.store.evictions,
        )


class MlxMemoryCollector(Collector):
    """MLX's memory in this process, read from its allocator at scrape time: the
    device's use is active plus cache, and the cache, bounded by ``serve
    --mlx-cache-limit``, is where freed buffers of changing batch shapes pile up."""

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "turbospark_mlx_active_bytes",
            "Bytes of MLX arrays alive now (weights, sessions, a step's buffers).",
            mx.get_active_memory(),
        )
        yield GaugeMetricFamily(
            "turbospark_mlx_cache_bytes",
            "Bytes of freed buffers MLX keeps for reuse (bounded by --mlx-cache-limit, "
            "else by MLX's memory limit).",
            mx.get_cache_memory(),
        )
        yield GaugeMetricFamily(
            "turbospark_mlx_peak_bytes",
            "The most bytes of MLX arrays alive at once since the process started.",
            mx.get_peak_memory(),
        )


def _expert_cache_metrics(engine: Engine) -> Iterator[Metric]:
    """The routed-expert cache (``Runner.expert_cache_stats``); nothing for a model
    without MoE experts. Plain counters, read without the runner thread."""
    stats = engine.runner.expert_cache_stats()
    if stats is None:
        return
    for name, help_text, value in [
        ("hits", "Experts a step routed to that were resident.", stats.hits),
        ("misses", "Experts a step routed to that were read from the install.", stats.misses),
        ("read_bytes", "Bytes of expert weights read from the install.", stats.bytes_read),
    ]:
        yield CounterMetricFamily(f"turbospark_expert_cache_{name}", help_text, value)
    yield GaugeMetricFamily(
        "turbospark_expert_cache_resident_bytes",
        "Bytes of routed-expert weights resident now, every MoE layer.",
        stats.resident_bytes,
    )
    yield GaugeMetricFamily(
        "turbospark_expert_cache_slots",
        "Experts resident per MoE layer (num_experts under ExpertCacheSlots.all()).",
        stats.slots_per_layer,
    )


class Metrics:
    """The app's registry and the metrics in it."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "turbospark_requests",
            "HTTP requests to the completion endpoints, by endpoint and outcome "
            "(ok, refused: a 4xx, error: a 5xx, cancelled: the client hung up).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "turbospark_prompt_tokens", "Prompt tokens of finished generations.", registry=r
        )
        self.reused_tokens = Counter(
            "turbospark_reused_tokens",
            "Prompt tokens a kept session already held (not prefilled again).",
            registry=r,
        )
        self.completion_tokens = Counter(
            "turbospark_completion_tokens", "Tokens generated.", registry=r
        )
        self.generations = Counter(
            "turbospark_generations",
            "Generations (engine rows) that ended, by outcome (finished, failed).",
            ["outcome"],
            registry=r,
        )
        self.reuse = Counter(
            "turbospark_reuse",
            "Finished generations by the reason their session was chosen.",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "turbospark_time_to_first_token_seconds",
            "Queue wait plus prefill of each finished generation.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(engine))
        r.register(MlxMemoryCollector())

    def observe(self, job: Job, stats: GenerationStats | None) -> None:
        """The engine's observer: one call per real request that ended."""
        if stats is None:
            self.generations.labels("failed").inc()
            return
        self.generations.labels("finished").inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.reused_tokens.inc(stats.reused_tokens)
        self.completion_tokens.inc(stats.generated_tokens)
        self.reuse.labels(stats.reuse_reason).inc()
        self.ttft.observe(stats.queued_seconds + stats.prefill_seconds)

    def counted(self, endpoint: str, handler: Handler) -> Handler:
        """*handler*, its requests counted by outcome (a stream when it ends:
        ``cancelled`` when the client closed it first)."""

        @functools.wraps(handler)
        async def wrapper(request: Request) -> Response:
            try:
                response = await handler(request)
            except APIError as exc:
                self.requests.labels(endpoint, _outcome(exc.status)).inc()
                raise
            except ClientGone:
                self.requests.labels(endpoint, "cancelled").inc()
                raise
            except Exception:
                self.requests.labels(endpoint, "error").inc()
                raise
            if isinstance(response, EventStream):
                response.on_end = lambda whole: self.requests.labels(
                    endpoint, "ok" if whole else "cancelled"
                ).inc()
            else:
                self.requests.labels(endpoint, _outcome(response.status_code)).inc()
            return response

        return wrapper

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return "refused" if status < 500 else "error"
