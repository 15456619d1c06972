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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry, max_k: int):
        r = registry
        self.positions = [str(i) for i in range(1, max_k + 1)]
        self.rounds = Counter("specdec_rounds_total", "Draft/verify rounds (target forward passes)", registry=r)
        self.draft_tokens = Counter("specdec_draft_tokens_total", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("specdec_accepted_tokens_total", "Draft tokens accepted", registry=r)
        self.rejected_rounds = Counter("specdec_rejected_rounds_total", "Rounds that ended in a rejection", registry=r)
        self.draft_per_position = Counter("specdec_draft_tokens_per_position_total",
                                          "Draft tokens proposed at each draft position", ["position"], registry=r)
        self.accepted_per_position = Counter("specdec_accepted_tokens_per_position_total",
                                             "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.lookup_rounds = Counter("specdec_lookup_rounds_total",
                                     "Rounds whose proposal came from prompt lookup instead of the draft", registry=r)
        self.lookup_tokens = Counter("specdec_lookup_tokens_total",
                                     "Tokens proposed by prompt lookup (also in specdec_draft_tokens_total)", registry=r)
        self.lookup_accepted_tokens = Counter("specdec_lookup_accepted_tokens_total",
                                              "Prompt-lookup tokens accepted (also in specdec_accepted_tokens_total)",
                                              registry=r)
        self.tokens_per_round = Histogram("specdec_tokens_per_round", "Tokens emitted per round",
                                          buckets=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17], registry=r)
        self.request_acceptance = Histogram("specdec_request_acceptance_rate",
                                            "Acceptance rate (accepted/drafted) of each finished request",
                                            buckets=[0.1 * i for i in range(11)], registry=r)
        self.generated_tokens = Counter("specdec_generated_tokens_total", "Tokens returned to clients", registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens_total", "Prompt tokens of admitted requests", registry=r)
        self.requests = Counter("specdec_requests_total", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.request_errors = Counter("specdec_request_errors_total", "Requests ended by an error status", ["code"], registry=r)
        self.phase_seconds = Histogram("specdec_round_phase_seconds",
                                       "Time of one decoding round by phase: draft and verify compute on the servers "
                                       "(the batched passes the calls ran in), queue (waiting for a pass), accept on "
                                       "the orchestrator, and rpc (network, serialization, the servers' Python); "
                                       "rounds that build a session are in specdec_prefill_round_seconds instead",
                                       ["phase"], buckets=_SECONDS, registry=r)
        self.round_seconds = Histogram("specdec_round_seconds", "Wall time of one decoding round (as above)",
                                       buckets=_SECONDS, registry=r)
        self.prefill_round_seconds = Histogram(
            "specdec_prefill_round_seconds", "Wall time of a round that built a server's session from the history: "
            "the rounds that carry the prompt's prefill (by default a request's first two: the target's, then the "
            "draft's), or a rebuild after a server lost it",
            buckets=_SECONDS, registry=r)
        self.speculative_tokens = Histogram(
            "specdec_speculative_tokens", "Tokens proposed per decoding round (K; with adaptive speculation the "
            "orchestrator chooses it round by round)", buckets=list(range(max_k + 1)), registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time from request to its first token",
                              buckets=_SECONDS, registry=r)
        self.inter_token = Histogram("specdec_inter_token_seconds", "Time between streamed messages of a request",
                                     buckets=_SECONDS, registry=r)
        self.wire_bytes = Histogram("specdec_wire_bytes_per_round", "Protobuf bytes sent and received per round",
                                    buckets=[64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536, 262144, 1 << 20],
                                    registry=r)
        self.rpcs_per_round = Histogram("specdec_rpcs_per_round", "Model-server RPCs per round",
                                        buckets=[1, 2, 3, 4, 6, 8], registry=r)
        self.rebuilds = Counter("specdec_session_rebuilds_total", "Sessions resent after a server lost them",
                                ["service"], registry=r)
        self.draft_fallbacks = Counter("specdec_draft_fallback_rounds_total",
                                       "Rounds decoded by the target alone because no draft replica was available",
                                       registry=r)
        # Replicas (orchestrator/replicas.py): where generations go, and where they go when a replica fails.
        self.replica_up = Gauge("specdec_replica_up", "1 while a model-server replica answers and takes "
                                "generations, 0 while it is down or draining", ["role", "replica"], registry=r)
        self.replica_sessions = Gauge("specdec_replica_sessions", "KV sessions a replica holds, from its last "
                                      "report (all orchestrators' generations)", ["role", "replica"], registry=r)
        self.replica_generations = Counter("specdec_replica_generations_total", "Generations this orchestrator "
                                           "placed on a replica, the moved ones included", ["role", "replica"],
                                           registry=r)
        self.replica_failovers = Counter("specdec_replica_failovers_total", "Generations moved off a replica "
                                         "that failed them (down, restarting, draining or full)", ["role", "replica"],
                                         registry=r)
        self.replica_rebuilds = Counter("specdec_replica_rebuilds_total", "Sessions resent to a replica that lost "
                                        "them (restarted, expired, evicted)", ["role", "replica"], registry=r)
        self.failover_seconds = Histogram("specdec_failover_recovery_seconds", "From a replica's failed call to "
                                          "the generation's next answered one on another replica (or the same, back)",
                                          ["role"], buckets=_SECONDS, registry=r)
        self.active = Gauge("specdec_active_requests", "Requests being generated", registry=r)
        self.waiting = Gauge("specdec_waiting_requests", "Requests waiting in line for a KV session and tokens "
                             "on the model servers (--max-concurrent-requests)", registry=r)
        for p in self.positions:  # expose zeros so rate() works from the first scrape
            self.draft_per_position.labels(p)
            self.accepted_per_position.labels(p)
        for phase in ("draft", "verify", "queue", "accept", "rpc"):
            self.phase_seconds.labels(phase)
        for role in ("draft", "target"):
            self.failover_seconds.labels(role)
            self.rebuilds.labels(role)

    def replica_seen(self, role: str, replica: str) -> None:
        """Export a replica's counters at zero from the moment it is known, so that rate() sees its first events."""
        self.replica_generations.labels(role, replica)
        self.replica_failovers.labels(role, replica)
        self.replica_rebuilds.labels(role, replica)
