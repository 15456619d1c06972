"""Prometheus metrics of the speculative loop.

Rates are derived in PromQL from counters, never kept as gauges:
- acceptance rate (accepted / drafted):
    rate(specdec_accepted_tokens_total[5m]) / rate(specdec_draft_tokens_total[5m])
- alpha (Leviathan's per-position acceptance):
    rate(specdec_accepted_tokens_total[5m])
      / (rate(specdec_accepted_tokens_total[5m]) + rate(specdec_rejected_rounds_total[5m]))
- mean tokens per round:
    rate(specdec_tokens_per_round_sum[5m]) / rate(specdec_tokens_per_round_count[5m])
- the share of proposed tokens that came from prompt lookup, and their acceptance rate:
    rate(specdec_lookup_tokens_total[5m]) / rate(specdec_draft_tokens_total[5m])
    rate(specdec_lookup_accepted_tokens_total[5m]) / rate(specdec_lookup_tokens_total[5m])
- acceptance at draft position i (1-based):
    rate(specdec_accepted_tokens_per_position_total{position="i"}[5m])
      / rate(specdec_draft_tokens_per_position_total{position="i"}[5m])
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from orchestrator.speculation import CallCost

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


@dataclass
class RoundTrace:
    """What a round did on the wire and in time; exported as metrics."""

    rpcs: int = 0
    bytes: int = 0
    draft_s: float = 0.0
    draft_wall_s: float = 0.0  # the draft call's wall time, draft_s included
    draft_built: bool = False  # the draft call built the draft's session (the prompt's prefill, or a rebuild)
    verify_s: float = 0.0
    queue_s: float = 0.0  # waiting for the servers' passes
    rpc_s: float = 0.0
    built: bool = False  # a call (re)built a session from the history: the prompt's prefill, or a rebuild
    draft_cost: CallCost | None = None  # the draft's and the target's calls, for adaptive speculation
    target_cost: CallCost | None = None
    recover_s: float = 0.0  # a sampled rejection's recovery: its candidates tested, or the residual drawn
    recovered_by: str = ""  # how a sampled rejection was recovered: "candidate" or "residual"

    def add_call(self, req, resp, wall_s: float, compute_field: str | None) -> None:
        """One call of the round: a ProposeTokens (compute_field "draft_s") or a Verify ("verify_s"), whose
        servers report their compute and queueing, or (None) a GetDistribution."""
        self.rpcs += 1
        self.bytes += req.ByteSize() + resp.ByteSize()
        compute = getattr(resp, "compute_seconds", 0.0) if compute_field else 0.0
        queued = resp.batch.queue_seconds if compute_field else 0.0
        if compute_field:
            setattr(self, compute_field, getattr(self, compute_field) + compute)
            self.queue_s += queued
            self.built = self.built or req.cursor.expected_length == 0
        self.rpc_s += max(wall_s - compute - queued, 0.0)


class OrchestratorMetrics:
    """The orchestrator's metrics, registered on registry; max_k (the largest K) sets the draft positions
    labelled and K's buckets. Registration order is the exposition's order: each group adds its own in turn."""

    def __init__(self, registry: CollectorRegistry, max_k: int):
        self.positions = [str(i) for i in range(1, max_k + 1)]
        self._add_round_metrics(registry)
        self._add_request_metrics(registry)
        self._add_cost_metrics(registry, max_k)
        self._add_failover_metrics(registry)
        self._add_load_metrics(registry)
        self._export_zeros()

    def _add_round_metrics(self, r: CollectorRegistry) -> None:
        """What the rounds proposed and what the target accepted: overall, per draft position, from prompt lookup."""
        self.rounds = Counter("specdec_rounds_total", "Draft/verify rounds (target forward passes)", registry=r)
        self.draft_tokens = Counter("specdec_draft_tokens_total", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("specdec_accepted_tokens_total", "Draft tokens accepted", registry=r)
        self.rejected_rounds = Counter("specdec_rejected_rounds_total", "Rounds that ended in a rejection", registry=r)
        self.recoveries = Counter(
            "specdec_recoveries_total",
            "Sampled rejections, by what drew the token: a candidate from the target's row, or the residual of "
            "both whole rows",
            ["by"],
            registry=r,
        )
        self.draft_per_position = Counter(
            "specdec_draft_tokens_per_position_total",
            "Draft tokens proposed at each draft position",
            ["position"],
            registry=r,
        )
        self.accepted_per_position = Counter(
            "specdec_accepted_tokens_per_position_total",
            "Draft tokens accepted at each draft position",
            ["position"],
            registry=r,
        )
        self.lookup_rounds = Counter(
            "specdec_lookup_rounds_total",
            "Rounds whose proposal came from prompt lookup instead of the draft",
            registry=r,
        )
        self.lookup_tokens = Counter(
            "specdec_lookup_tokens_total",
            "Tokens proposed by prompt lookup (also in specdec_draft_tokens_total)",
            registry=r,
        )
        self.lookup_accepted_tokens = Counter(
            "specdec_lookup_accepted_tokens_total",
            "Prompt-lookup tokens accepted (also in specdec_accepted_tokens_total)",
            registry=r,
        )
        self.tokens_per_round = Histogram(
            "specdec_tokens_per_round",
            "Tokens emitted per round",
            buckets=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17],
            registry=r,
        )

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Finished requests: their acceptance, tokens in and out, how they ended."""
        self.request_acceptance = Histogram(
            "specdec_request_acceptance_rate",
            "Acceptance rate (accepted/drafted) of each finished request",
            buckets=[0.1 * i for i in range(11)],
            registry=r,
        )
        self.generated_tokens = Counter("specdec_generated_tokens_total", "Tokens returned to clients", registry=r)
        self.run_tokens = Counter(
            "specdec_run_tokens_total",
            "Tokens the target picked alone after a K = 0 round's first, in the same call (--steps-per-call)",
            registry=r,
        )
        self.prompt_tokens = Counter("specdec_prompt_tokens_total", "Prompt tokens of admitted requests", registry=r)
        self.requests = Counter(
            "specdec_requests_total", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.request_errors = Counter(
            "specdec_request_errors_total", "Requests ended by an error status", ["code"], registry=r
        )

    def _add_cost_metrics(self, r: CollectorRegistry, max_k: int) -> None:
        """What decoding costs: a round's time by phase, its K and its wire traffic, and the latency a client sees."""
        self.phase_seconds = Histogram(
            "specdec_round_phase_seconds",
            "Time of one decoding round by phase: draft and verify compute on the servers "
            "(the batched passes the calls ran in), queue (waiting for a pass), accept on "
            "the orchestrator, and rpc (network, serialization, the servers' Python); "
            "rounds that build a session are in specdec_prefill_round_seconds instead",
            ["phase"],
            buckets=_SECONDS,
            registry=r,
        )
        self.round_seconds = Histogram(
            "specdec_round_seconds", "Wall time of one decoding round (as above)", buckets=_SECONDS, registry=r
        )
        self.prefill_round_seconds = Histogram(
            "specdec_prefill_round_seconds",
            "Wall time of a round that built a server's session from the history: "
            "the rounds that carry the prompt's prefill (by default a request's first two: the target's, then the "
            "draft's), or a rebuild after a server lost it",
            buckets=_SECONDS,
            registry=r,
        )
        self.speculative_tokens = Histogram(
            "specdec_speculative_tokens",
            "Tokens proposed per decoding round (K; with adaptive speculation the "
            "orchestrator chooses it round by round)",
            buckets=list(range(max_k + 1)),
            registry=r,
        )
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds", "Time from request to its first token", buckets=_SECONDS, registry=r
        )
        self.inter_token = Histogram(
            "specdec_inter_token_seconds", "Time between streamed messages of a request", buckets=_SECONDS, registry=r
        )
        self.wire_bytes = Histogram(
            "specdec_wire_bytes_per_round",
            "Protobuf bytes sent and received per round",
            buckets=[64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536, 262144, 1 << 20],
            registry=r,
        )
        self.rpcs_per_round = Histogram(
            "specdec_rpcs_per_round", "Model-server RPCs per round", buckets=[1, 2, 3, 4, 6, 8], registry=r
        )

    def _add_failover_metrics(self, r: CollectorRegistry) -> None:
        """Replicas (orchestrator/replicas.py) and failover (orchestrator/failover.py): where generations go, and
        what happens to them when a server fails."""
        self.rebuilds = Counter(
            "specdec_session_rebuilds_total", "Sessions resent after a server lost them", ["service"], registry=r
        )
        self.preemptions = Counter(
            "specdec_preemptions_total",
            "Generations that gave their KV up to an older one's growth, to be rebuilt from their history",
            registry=r,
        )
        self.draft_fallbacks = Counter(
            "specdec_draft_fallback_rounds_total",
            "Rounds decoded by the target alone because no draft replica was available",
            registry=r,
        )
        self.replica_up = Gauge(
            "specdec_replica_up",
            "1 while a model-server replica answers and takes generations, 0 while it is down or draining",
            ["role", "replica"],
            registry=r,
        )
        self.replica_sessions = Gauge(
            "specdec_replica_sessions",
            "KV sessions a replica holds, from its last report (all orchestrators' generations)",
            ["role", "replica"],
            registry=r,
        )
        self.replica_generations = Counter(
            "specdec_replica_generations_total",
            "Generations this orchestrator placed on a replica, the moved ones included",
            ["role", "replica"],
            registry=r,
        )
        self.replica_failovers = Counter(
            "specdec_replica_failovers_total",
            "Generations moved off a replica that failed them (down, restarting, draining or full)",
            ["role", "replica"],
            registry=r,
        )
        self.replica_rebuilds = Counter(
            "specdec_replica_rebuilds_total",
            "Sessions resent to a replica that lost them (restarted, expired, evicted)",
            ["role", "replica"],
            registry=r,
        )
        self.failover_seconds = Histogram(
            "specdec_failover_recovery_seconds",
            "From a replica's failed call to the generation's next answered one on another replica (or the same, back)",
            ["role"],
            buckets=_SECONDS,
            registry=r,
        )

    def _add_load_metrics(self, r: CollectorRegistry) -> None:
        """Requests being generated and waiting in line (orchestrator/admission.py)."""
        self.active = Gauge("specdec_active_requests", "Requests being generated", registry=r)
        self.waiting = Gauge(
            "specdec_waiting_requests",
            "Requests waiting in line for a KV session and tokens on the model servers (--max-concurrent-requests)",
            registry=r,
        )

    def _export_zeros(self) -> None:
        """Expose the labelled series known from the start at zero, so that rate() works from the first scrape."""
        for p in self.positions:
            self.draft_per_position.labels(p)
            self.accepted_per_position.labels(p)
        for phase in ("draft", "verify", "queue", "accept", "rpc"):
            self.phase_seconds.labels(phase)
        for way in ("candidate", "residual"):
            self.recoveries.labels(way)
        for role in ("draft", "target"):
            self.failover_seconds.labels(role)
            self.rebuilds.labels(role)

    def replica_seen(self, role: str, replica: str) -> None:
        """Export a replica's counters at zero from the moment it is known, so that rate() sees its first events."""
        self.replica_generations.labels(role, replica)
        self.replica_failovers.labels(role, replica)
        self.replica_rebuilds.labels(role, replica)

    def record_round(
        self, k: int, n: int, emitted: int, trace: RoundTrace, round_s: float, accept_s: float, looked_up: bool, run=0
    ) -> None:
        """A finished round: k tokens proposed (by prompt lookup where looked_up), n of them accepted, run tokens the
        target ran alone after the round's own, emitted tokens streamed, round_s of wall time, the last accept_s of
        it on the orchestrator."""
        if looked_up:
            self.lookup_rounds.inc()
            self.lookup_tokens.inc(k)
            self.lookup_accepted_tokens.inc(n)
        self.rounds.inc()
        self.draft_tokens.inc(k)
        self.accepted_tokens.inc(n)
        if n < k:
            self.rejected_rounds.inc()
        if trace.recovered_by:
            self.recoveries.labels(trace.recovered_by).inc()
        for i in range(k):
            self.draft_per_position.labels(self.positions[i]).inc()
            if i < n:
                self.accepted_per_position.labels(self.positions[i]).inc()
        self.tokens_per_round.observe(n + 1 + run)
        self.run_tokens.inc(run)
        self.generated_tokens.inc(emitted)
        if trace.built:  # a prefill's time says nothing of a decoding round's: it is timed apart
            self.prefill_round_seconds.observe(round_s)
        else:
            self.phase_seconds.labels("draft").observe(trace.draft_s)
            self.phase_seconds.labels("verify").observe(trace.verify_s)
            self.phase_seconds.labels("rpc").observe(trace.rpc_s)
            self.phase_seconds.labels("queue").observe(trace.queue_s)
            self.phase_seconds.labels("accept").observe(accept_s)
            self.round_seconds.observe(round_s)
            self.speculative_tokens.observe(k)
        self.wire_bytes.observe(trace.bytes)
        self.rpcs_per_round.observe(trace.rpcs)
