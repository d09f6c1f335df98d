"""Prometheus metrics of one node: its NodeStats read at scrape time, and the head's per-request latencies.

Scrape `http://HOST:METRICS_PORT/metrics` (prima-node --metrics-port). The per-node series come from
`Node.info()` when Prometheus asks, so the node keeps no second set of books; the request series
(TTFT, TPOT, tokens, requests, errors) are observed by the head's Inference.Generate.
"""

import hmac
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from prima_rpc.v1 import prima_pb2 as pb

if TYPE_CHECKING:  # aiohttp is imported by the nodes that serve metrics only (~0.3 s of every node's start)
    from aiohttp import web

# Latency buckets in seconds: loopback SmolLM2 tokens take ~10-100 ms, a 70B ring on home devices ~1-10 s.
LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)

# Request metrics are per process (one node per process); `registry_for` adds them to a node's registry.
TTFT = Histogram("prima_ttft_seconds", "Time to first token of finished requests (head)",
                 buckets=LATENCY_BUCKETS, registry=None)
TPOT = Histogram("prima_tpot_seconds", "Mean time per output token after the first, per finished request (head)",
                 buckets=LATENCY_BUCKETS, registry=None)
TOKENS = Counter("prima_generated_tokens", "Tokens streamed to clients (head)", registry=None)
PROMPT_TOKENS = Counter("prima_prompt_tokens", "Prompt tokens of finished requests (head)", registry=None)
REQUESTS = Counter("prima_requests", "Finished requests by finish reason (head)", ["finish_reason"], registry=None)
DRAFTED = Counter("prima_drafted_tokens", "Tokens drafted for speculative verification (head)", registry=None)
ACCEPTED = Counter("prima_accepted_tokens", "Drafted tokens the target model accepted (head)", registry=None)
ERRORS = Counter("prima_request_errors", "Requests that ended with a gRPC error status (head)", ["code"],
                 registry=None)
SERVED = Counter("prima_served_bytes", "Store bytes this node sent to other nodes (Control.Fetch)", registry=None)


def observe_served(n: int) -> None:
    SERVED.inc(n)


def observe_token() -> None:
    TOKENS.inc()


def observe_finished(done: pb.Finished) -> None:
    REQUESTS.labels(done.finish_reason or "unknown").inc()
    PROMPT_TOKENS.inc(done.prompt_tokens)
    DRAFTED.inc(done.drafted)
    ACCEPTED.inc(done.accepted)
    if done.completion_tokens:
        TTFT.observe(done.ttft_ms / 1e3)
    if done.completion_tokens > 1:  # TPOT needs two tokens
        TPOT.observe(done.tpot_ms / 1e3)


def observe_error(code: grpc.StatusCode) -> None:
    ERRORS.labels(code.name).inc()


class NodeCollector(Collector):
    """The node's NodeStats as Prometheus series, read from `node.info()` at scrape time.

    Counters never go back: compute_s is reported net of stall_s, which a frame in progress can
    briefly push down; a scrape then repeats the last value instead of looking like a restart."""

    COUNTERS = (  # (NodeStats field, metric name without _total, help)
        ("compute_s", "prima_compute_seconds", "Compute thread time on frames, waits for streamed layers excluded"),
        ("stall_s", "prima_stall_seconds", "Compute time spent waiting for layers streamed from disk"),
        ("link_s", "prima_link_seconds", "Time spent sending frames to the successor"),
        ("frames", "prima_frames", "Frames computed"),
        ("disk_read_bytes", "prima_disk_read_bytes", "Bytes read from the layer store"),
        ("batches", "prima_batches", "Computes run, each one pass over the weights for a batch of frames"),
        ("batched_frames", "prima_batched_frames", "Frames computed in batches (mean batch: this / prima_batches)"),
        ("queue_wait_s", "prima_queue_wait_seconds", "Time frames waited in the inbox before their compute"),
        ("prefilled_tokens", "prima_prefilled_tokens", "Prompt positions computed"),
        ("prefix_hit_tokens", "prima_prefix_hit_tokens", "Prompt positions copied from the prefix cache instead"),
        ("prefix_disk_tokens", "prima_prefix_disk_tokens", "Prefix positions read from disk instead of prefilled"),
    )
    GAUGES = (
        ("resident_bytes", "prima_resident_bytes", "Weights and KV caches held in memory"),
        ("rss_bytes", "prima_rss_bytes", "Resident set size of the node process"),
        ("active_requests", "prima_active_requests", "Requests with a KV cache on this node"),
        ("queue_depth", "prima_queue_depth", "Frames waiting in the inbox"),
        ("max_batch_seen", "prima_max_batch_seen", "The largest batch computed"),
        ("max_batch", "prima_max_batch", "The most frames one compute takes (this node's limit)"),
        ("prefix_cached_tokens", "prima_prefix_cached_tokens", "Positions the prefix cache holds"),
        ("prefix_disk_bytes", "prima_prefix_disk_bytes", "Bytes of this node's prefix files on disk"),
    )

    def __init__(self, node):
        self.node = node
        self._high: dict[str, float] = {}  # counter name -> highest value reported

    def _info(self) -> pb.NodeInfo:
        # Scrapes run on the event loop, but the compute thread may resize the shard's dicts meanwhile.
        for _ in range(3):
            try:
                return self.node.info()
            except RuntimeError:  # dictionary changed size during iteration
                continue
        return self.node.info()

    def collect(self) -> Iterator[Metric]:
        info = self._info()
        s = info.stats
        node_labels = {"name": info.name, "role": info.role, "model": info.model_name,
                       "windows": " ".join(f"[{r.start},{r.stop})" for r in info.windows)}
        yield InfoMetricFamily("prima_node", "This node's name, role, model and layer windows", value=node_labels)
        for field, name, doc in self.COUNTERS:
            value = max(float(getattr(s, field)), self._high.get(name, 0.0))
            self._high[name] = value
            yield CounterMetricFamily(name, doc, value=value)
        for field, name, doc in self.GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(s, field))
        yield GaugeMetricFamily("prima_last_token_seconds", "Duration of the head's last token round trip",
                                value=s.last_token_ms / 1e3)
        value = max(float(info.fetched_bytes), self._high.get("fetched", 0.0))
        self._high["fetched"] = value
        yield CounterMetricFamily("prima_fetched_bytes", "Store bytes fetched from other nodes", value=value)
        yield GaugeMetricFamily("prima_cached_units", "Weight units whose files are on this node's disk",
                                value=info.cached_units)
        yield GaugeMetricFamily("prima_epoch", "Ring epoch the node serves (changes on every re-plan)",
                                value=info.epoch)
        yield from span_families(self.node.spans.snapshot())
        yield from owner_families(info)


def owner_families(info: pb.NodeInfo) -> Iterator[Metric]:
    """What the device's owner left the node (nodes/ring/owner.py) and the head's live re-plans (replanner.py)."""
    yield GaugeMetricFamily("prima_available_memory_bytes", "The device's available memory",
                            value=info.available_memory)
    if info.memory_pressure >= 0:
        yield GaugeMetricFamily("prima_memory_pressure_percent", "PSI memory some avg10: share of the last 10 s some "
                                "task stalled on memory", value=info.memory_pressure)
    yield GaugeMetricFamily("prima_memory_low", "1 while the node gave memory back and waits for a re-plan",
                            value=float(info.memory_low))
    yield GaugeMetricFamily("prima_max_cpu", "The share of the device's cores the node may use", value=info.max_cpu)
    if info.role != "head":
        return
    replans = CounterMetricFamily("prima_replans", "Live re-plans the head made, by reason (slower, faster, memory)",
                                  labels=["reason"])
    for reason in ("slower", "faster", "memory"):
        replans.add_metric([reason], sum(r.reason == reason for r in info.replans))
    yield replans
    if info.replans:
        last = info.replans[-1]
        yield GaugeMetricFamily("prima_last_replan_timestamp_seconds", "When the last live re-plan was applied",
                                value=last.at)
        yield GaugeMetricFamily("prima_last_replan_seconds", "How long the last live re-plan took", value=last.seconds)
        yield GaugeMetricFamily("prima_last_replan_gain", "The share of TPOT the last live re-plan was predicted to "
                                "save", value=last.predicted_gain)


def span_families(spans: dict[str, tuple[float, int]]) -> Iterator[Metric]:
    """The hot path's spans (nodes/ring/spans.py): seconds and count by span, e.g. Shard.compute_batch.wait."""
    seconds = CounterMetricFamily("prima_span_seconds", "Time in each span of the hot path", labels=["span"])
    counts = CounterMetricFamily("prima_spans", "Times each span of the hot path ran", labels=["span"])
    for name, (s, n) in sorted(spans.items()):
        seconds.add_metric([name], s)
        counts.add_metric([name], n)
    yield seconds
    yield counts


def registry_for(node) -> CollectorRegistry:
    """A registry with the node's stats, the process's request metrics and the process's CPU/memory."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(NodeCollector(node))
    for metric in (TTFT, TPOT, TOKENS, PROMPT_TOKENS, DRAFTED, ACCEPTED, REQUESTS, ERRORS, SERVED):
        registry.register(metric)
    ProcessCollector(registry=registry)
    return registry


def make_app(registry: CollectorRegistry, token: str | None = None) -> "web.Application":
    """GET /metrics; with a cluster token, only for `Authorization: Bearer TOKEN` (Prometheus: authorization)."""
    from aiohttp import web
    from prometheus_client.aiohttp import make_aiohttp_handler

    middlewares = []
    if token:
        expected = f"Bearer {token}".encode()

        @web.middleware
        async def auth(request: web.Request, handler) -> web.StreamResponse:
            if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
                raise web.HTTPUnauthorized(text="send 'Authorization: Bearer <the ring's token>'\n")
            return await handler(request)

        middlewares.append(auth)
    app = web.Application(middlewares=middlewares)
    app.router.add_get("/metrics", make_aiohttp_handler(registry))
    return app


async def start(node, host: str, port: int, token: str | None = None) -> "web.AppRunner":
    """Serve the node's metrics on the running loop; the caller cleans the runner up."""
    from aiohttp import web

    runner = web.AppRunner(make_app(registry_for(node), token), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner
