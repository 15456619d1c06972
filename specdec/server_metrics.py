"""The Prometheus metrics of a draft or target model server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
_ROWS_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048, 4096)
_SESSIONS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)


def model_info(registry: CollectorRegistry, info) -> Info:
    """specdec_model_info{model, device, dtype, numerics}: what the server serves and the numbers its passes compute,
    from its ModelInfo (None: unlabelled)."""
    metric = Info("specdec_model", "What this server serves and the numbers its passes compute", registry=registry)
    if info is not None:
        metric.info({"model": info.model, "device": info.device, "dtype": info.dtype, "numerics": info.numerics})
    return metric


class ModelServerMetrics:
    def __init__(self, registry: CollectorRegistry, info=None):
        self.model = model_info(registry, info)  # info: the server's ModelInfo
        self.sessions = Gauge("specdec_kv_sessions", "Sessions held in the KV pool", registry=registry)
        self.sessions_capacity = Gauge(
            "specdec_kv_sessions_capacity", "Most sessions the pool holds", registry=registry
        )
        self.tokens = Gauge("specdec_kv_tokens", "Tokens held in the KV pool", registry=registry)
        self.tokens_capacity = Gauge("specdec_kv_tokens_capacity", "Most tokens the pool holds", registry=registry)
        self.forward_seconds = Histogram(
            "specdec_forward_seconds",
            "Time of one model forward pass",
            ["tokens"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.rpc_seconds = Histogram(
            "specdec_server_rpc_seconds",
            "Time to serve one RPC, queueing included",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.rpc_errors = Counter(
            "specdec_server_rpc_errors_total",
            "RPCs answered with an error status",
            ["method", "code"],
            registry=registry,
        )
        self.sessions_expired = Counter("specdec_kv_sessions_expired_total", "Idle sessions freed", registry=registry)
        self.batch_rows = Histogram(
            "specdec_batch_rows",
            "Rows (new tokens of every session) of one forward pass",
            buckets=_ROWS_BUCKETS,
            registry=registry,
        )
        self.batch_sessions = Histogram(
            "specdec_batch_sessions", "Sessions in one forward pass", buckets=_SESSIONS_BUCKETS, registry=registry
        )
        self.queue_wait = Histogram(
            "specdec_queue_wait_seconds",
            "Time a call waited for its first forward pass",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queued = Gauge("specdec_queued_calls", "Calls waiting for a forward pass", registry=registry)
        self.prefix_hits = Counter(
            "specdec_prefix_cache_hit_tokens_total",
            "Tokens a new session took from the prefix cache instead of computing them",
            registry=registry,
        )
        self.prefix_tokens = Gauge("specdec_prefix_cache_tokens", "Tokens held in the prefix cache", registry=registry)
        self._rules(registry)
        self._passes(registry)

    def _passes(self, registry: CollectorRegistry) -> None:
        self.forward_tokens = Counter(
            "specdec_forward_tokens_total", "Tokens fed through forward passes (rows)", registry=registry
        )
        self.passes = Counter(
            "specdec_forward_passes",
            "Forward passes by how they ran: eager, or on a GPU replayed as CUDA graphs (graphed: one session's; "
            "in_turn: several sessions', one after another; captured: a pass that captured a graph)",
            ["way"],
            registry=registry,
        )
        # Each width's and way's series exists from the start at zero, so that rate() counts a series' first passes:
        # one created by its first observation, between two scrapes, starts at that value and rate() never sees it,
        # and a short request whose passes all fall between two scrapes would show no data.
        for width in _TOKENS_BUCKETS:
            self.forward_seconds.labels(width)
        for way in PASS_WAYS:
            self.passes.labels(way)

    def _rules(self, registry: CollectorRegistry) -> None:
        self.rules_seconds = Counter(
            "specdec_rules_seconds_total",
            "Seconds spent applying output rules (grammar masks, penalties, biases) to rows' logits",
            registry=registry,
        )
        self.rules_rows = Counter(
            "specdec_rules_rows_total", "Rows whose logits output rules changed", registry=registry
        )
        self.rules_wait_seconds = Counter(
            "specdec_rules_wait_seconds_total",
            "Seconds calls waited for their output rules after their forward pass (the masks run beside it)",
            registry=registry,
        )

    def observe_pass(self, rows: int, sessions: int, seconds: float, way: str = "eager") -> None:
        self.forward_seconds.labels(_tokens_bucket(rows)).observe(seconds)
        self.passes.labels(way).inc()
        self.batch_rows.observe(rows)
        self.batch_sessions.observe(sessions)
        self.forward_tokens.inc(rows)


_TOKENS_BUCKETS = ("1", "2-8", "9-64", "65+")
PASS_WAYS = ("eager", "graphed", "in_turn", "captured")  # specdec.runners.cuda_graphs.CudaGraphs.timed


def _tokens_bucket(n: int) -> str:
    """A bounded label for a forward pass's width."""
    return _TOKENS_BUCKETS[0 if n <= 1 else 1 if n <= 8 else 2 if n <= 64 else 3]
