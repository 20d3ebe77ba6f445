"""Prometheus metrics, one registry per server object (no globals: tests run several servers in
one process, and two registries never collide).

Latencies are histograms observed as requests finish; engine state (running/waiting, KV usage,
blocks, token and preemption counters) and transport totals are read at scrape time from a snapshot
taken on the engine thread, through a custom collector, so they are never stale or double-counted.
Names follow vLLM's (``vllm:time_to_first_token_seconds`` -> ``asympd_time_to_first_token_seconds``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Turns the latest ``engine.stats()`` + transport snapshot into metric families."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}
        self.transfers: dict[str, dict[str, Any]] = {}  # transport name -> TransferMetrics.snapshot()
        self.static: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        if s:
            yield gauge("asympd_num_requests_running", "Requests in the running batch.", s.get("running", 0))
            yield gauge("asympd_num_requests_waiting", "Requests waiting to be admitted.", s.get("waiting", 0))
            yield gauge(
                "asympd_num_requests_held_for_transfer",
                "Prefill worker: exported prefixes whose blocks wait for the decode worker's ack.",
                s.get("held_for_transfer", 0),
            )
            yield gauge(
                "asympd_kv_blocks_used", "Paged KV blocks in use (held by a request).", s.get("kv_blocks_used", 0)
            )
            yield gauge("asympd_kv_blocks_total", "Paged KV blocks in the pool.", s.get("kv_blocks_total", 0))
            usage = GaugeMetricFamily(
                "asympd_kv_usage_bytes", "KV cache bytes in use, per cache group.", labels=["group"]
            )
            for group, nbytes in sorted(s.get("kv_usage_bytes", {}).items()):
                usage.add_metric([str(group)], nbytes)
            yield usage
            yield counter("asympd_num_preemptions", "Requests preempted (recomputed later).", s.get("preemptions", 0))
            yield counter("asympd_prompt_tokens", "Prompt rows computed by this engine.", s.get("prompt_tokens", 0))
            yield counter("asympd_generation_tokens", "Tokens generated.", s.get("generation_tokens", 0))
            yield counter("asympd_engine_steps", "Engine steps run.", s.get("steps", 0))
            yield counter(
                "asympd_prefix_cache_queries",
                "Imported prefix positions looked up in the prefix cache at admission (vLLM's name).",
                s.get("prefix_cache_queries", 0),
            )
            yield counter(
                "asympd_prefix_cache_hits",
                "Of those, positions whose blocks were already held: shared, not written again.",
                s.get("prefix_cache_hits", 0),
            )
            if "busy_seconds" in s:
                yield counter(
                    "asympd_engine_busy_seconds",
                    "Wall seconds with a step in flight, on the host or on the GPU (the GPU work a step "
                    "leaves queued included; asympd_engine_step_seconds times the host alone).",
                    s["busy_seconds"],
                )
            if "new_shapes" in s:
                yield counter(
                    "asympd_engine_steps_new_shape",
                    "Serving steps that compiled a Triton kernel or captured a CUDA graph (a shape the "
                    "start-up warm-up and captures missed: a stall mid-traffic).",
                    s["new_shapes"]["steps"],
                )
            yield counter(
                "asympd_engine_steps_graphed",
                "Engine steps whose forward replayed a CUDA graph (the others ran eagerly).",
                s.get("graphed_steps", 0),
            )
            if s.get("num_spec_tokens"):
                yield gauge(
                    "asympd_spec_decode_num_spec_tokens", "Drafts per request per step (0: off).", s["num_spec_tokens"]
                )
                yield counter(
                    "asympd_spec_decode_verify_steps", "Request-steps that verified drafts.", s.get("spec_steps", 0)
                )
                yield gauge(
                    "asympd_spec_decode_acceptance_rate",
                    "Accepted / proposed drafts, all requests so far.",
                    s.get("spec_acceptance_rate", 0.0),
                )
                yield gauge(
                    "asympd_spec_decode_mean_accepted_length",
                    "Tokens per verify step (1 + accepted drafts), all requests so far.",
                    s.get("spec_mean_accepted_length", 0.0),
                )
        labels = ["transport", "direction"]
        nbytes = CounterMetricFamily("asympd_transfer_bytes", "Prefix-state bytes moved.", labels=labels)
        secs = CounterMetricFamily("asympd_transfer_seconds", "Seconds spent moving prefix states.", labels=labels)
        count = CounterMetricFamily("asympd_transfers", "Prefix-state transfers completed.", labels=labels)
        fails = CounterMetricFamily(
            "asympd_transfer_failures", "Prefix-state transfers that failed.", labels=["transport"]
        )
        for name, snap in sorted(self.transfers.items()):
            # totals are kept per transport; the direction is this worker's role in them
            direction = "send" if self.static.get("role") == "prefill" else "recv"
            nbytes.add_metric([name, direction], snap.get("bytes", 0))
            secs.add_metric([name, direction], snap.get("seconds", 0.0))
            count.add_metric([name, direction], snap.get("transfers", 0))
            fails.add_metric([name], snap.get("failures", 0))
        yield from (nbytes, secs, count, fails)
        if "resident_bytes" in self.static:
            yield gauge(
                "asympd_resident_weight_bytes",
                "Weight bytes this worker's role holds on its device.",
                self.static["resident_bytes"],
            )
        info = GaugeMetricFamily(
            "asympd_worker_info", "Static worker description (value 1).", labels=["role", "mode", "model"]
        )
        if self.static:
            info.add_metric(
                [str(self.static.get("role")), str(self.static.get("mode")), str(self.static.get("model"))], 1
            )
            yield info


class ServerMetrics:
    """A worker's metrics: request latencies, the TTFT split, failures, plus the engine collector."""

    def __init__(self, static: dict[str, Any] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist("asympd_time_to_first_token_seconds", "Time to first token, as this worker sees it.")
        self.itl = hist("asympd_inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = hist("asympd_e2e_request_latency_seconds", "Request latency, arrival to last token.")
        self.queue = hist(
            "asympd_request_queue_time_seconds",
            "Request added to the engine to its first step (vLLM's request_queue_time).",
        )
        self.ttft_prefill = hist(
            "asympd_ttft_prefill_seconds", "TTFT split: prefill worker compute (from its kv_transfer_params)."
        )
        self.ttft_transfer = hist("asympd_ttft_transfer_seconds", "TTFT split: fetching the prefix state.")
        self.ttft_decode = hist(
            "asympd_ttft_decode_first_step_seconds", "TTFT split: decode worker, request added to first token."
        )
        self.prefill_compute = hist(
            "asympd_prefill_compute_seconds", "Prefill worker: request added to prefix exported."
        )
        # its _sum is the engine's busy time: prompt tokens per busy second is a worker's capacity
        self.step = hist("asympd_engine_step_seconds", "Duration of each engine step.")
        self.requests = Counter(
            "asympd_request", "Finished requests, by finish reason.", ["finished_reason"], registry=r
        )
        self.request_errors = Counter(
            "asympd_request_errors", "Refused or failed requests, by HTTP status.", ["status"], registry=r
        )
        self.prefill_fallbacks = Counter(
            "asympd_prefill_fallbacks",
            "Decode worker: prefix recomputed because the prefill path failed.",
            ["reason"],
            registry=r,
        )
        self.prefix_state_refusals = Counter(
            "asympd_prefix_state_refusals",
            "Prefix states refused before use: forged, corrupted, replayed or for another prompt.",
            registry=r,
        )
        self.spec_draft = Counter("asympd_spec_decode_num_draft_tokens", "Speculative tokens proposed.", registry=r)
        self.spec_accepted = Counter(
            "asympd_spec_decode_num_accepted_tokens", "Speculative tokens accepted.", registry=r
        )
        self.engine = _EngineCollector()
        self.engine.static = dict(static or {})
        r.register(self.engine)

    def render(self, stats: dict[str, Any] | None, transfers: dict[str, dict[str, Any]]) -> bytes:
        """Prometheus text with the engine snapshot ``stats`` (None: the engine did not answer)."""
        self.engine.stats = stats or {}
        self.engine.transfers = transfers
        return generate_latest(self.registry)

    def finished(self, metrics: dict[str, float], reason: str | None, itl: list[float]) -> None:
        """Record one finished request (engine ``RequestOutput.metrics`` + token gaps); e2e is
        observed by the handler, which sees the whole request (fetch included)."""
        for gap in itl:
            self.itl.observe(gap)
        if metrics.get("queue") is not None:
            self.queue.observe(metrics["queue"])
        self.requests.labels(reason or "unknown").inc()
        if metrics.get("spec_proposed"):
            self.spec_draft.inc(metrics["spec_proposed"])
        if metrics.get("spec_accepted"):
            self.spec_accepted.inc(metrics["spec_accepted"])


class RouterMetrics:
    """The router's own view: end-to-end latencies as clients see them, and worker health."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "asympd_router_time_to_first_token_seconds",
            "TTFT seen by clients of the router.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "asympd_router_e2e_request_latency_seconds",
            "Request latency at the router.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_rtt = Histogram(
            "asympd_router_prefill_seconds", "Round trip of the prefill call.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter("asympd_router_requests", "Requests by outcome.", ["outcome"], registry=r)
        self.prefill_skipped = Counter(
            "asympd_router_prefill_skipped",
            "Asymmetric mode, prompt within the window: the prefill worker skipped.",
            registry=r,
        )
        self.prefill_failures = Counter(
            "asympd_router_prefill_failures", "Prefill calls that failed.", ["reason"], registry=r
        )
        self.aborts = Counter("asympd_router_aborts", "Requests aborted because the client left.", registry=r)
        self.workers = _WorkerCollector()
        r.register(self.workers)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerCollector(Collector):
    def __init__(self) -> None:
        self.workers: list[Any] = []  # router.Worker objects

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "asympd_router_worker_healthy", "1 if the worker passes /health.", labels=["kind", "url"]
        )
        load = GaugeMetricFamily(
            "asympd_router_worker_outstanding_tokens",
            "Tokens of requests in flight on the worker (the routing load).",
            labels=["kind", "url"],
        )
        inflight = GaugeMetricFamily(
            "asympd_router_worker_requests", "Requests in flight on the worker.", labels=["kind", "url"]
        )
        for w in self.workers:
            healthy.add_metric([w.kind, w.url], 1 if w.healthy else 0)
            load.add_metric([w.kind, w.url], w.outstanding_tokens)
            inflight.add_metric([w.kind, w.url], w.inflight)
        yield from (healthy, load, inflight)
