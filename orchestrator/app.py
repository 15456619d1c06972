"""Start-up of the orchestrator: connect to both model servers, check they fit together, serve."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from orchestrator.admission import Admission
from orchestrator.clients import ModelClient
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.openai_compat import start_http
from orchestrator.replicas import ReplicaSet, Role
from orchestrator.servicer import GenerationServicer, capacity
from specdec import models
from specdec.config import ConfigError, OrchestratorConfig
from specdec.server import create_server, mark_serving, serve, server_credentials, start_health_server, start_metrics
from specdec.v1 import draft_pb2_grpc, generation_pb2_grpc, model_server_pb2 as ms_pb, target_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "specdec.v1.Generation"


async def _first_report(replicas: ReplicaSet, timeout_s: float) -> ms_pb.ModelInfo:
    """The report of the first replica of the role to answer; the others report as the servicer refreshes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        await replicas.resolve()
        calls = {
            asyncio.ensure_future(
                r.client.stub.GetModelInfo(
                    ms_pb.GetModelInfoRequest(), wait_for_ready=True, timeout=max(min(deadline - loop.time(), 5.0), 0.1)
                )
            ): r
            for r in replicas
        }
        try:
            pending = set(calls)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for call in done:
                    if call.exception() is None:
                        calls[call].report(call.result())
                        return call.result()
            if not calls:
                await asyncio.sleep(1.0)  # the name resolves to no address yet (no pod ready)
        finally:
            for call in calls:
                call.cancel()
        if loop.time() >= deadline:
            raise ConfigError(
                f"no {replicas.role} service at {', '.join(e.address for e in replicas.endpoints)} "
                f"answered within {timeout_s:.0f} s; is it running?"
            )


def check_compatible(cfg: OrchestratorConfig, tokenizer, draft: ms_pb.ModelInfo, target: ms_pb.ModelInfo) -> None:
    """Refuse a pair that cannot be exact: different tokenizers, or limits below the configured K."""
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint or draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft {draft.model!r} (vocabulary {draft.vocab_size}, tokenizer {draft.tokenizer_fingerprint}) "
            f"and the target {target.model!r} (vocabulary {target.vocab_size}, tokenizer "
            f"{target.tokenizer_fingerprint}) do not share a tokenizer; pick a draft from the target's family"
        )
    mine = models.tokenizer_fingerprint(tokenizer)
    if mine != target.tokenizer_fingerprint:
        raise ConfigError(
            f"--tokenizer {cfg.tokenizer!r} ({mine}) is not the target's tokenizer "
            f"({target.tokenizer_fingerprint}); pass the target model there"
        )
    if draft.reads_features and (
        draft.feature_fingerprint != target.feature_fingerprint or draft.feature_size != target.feature_size
    ):
        raise ConfigError(
            f"the draft {draft.model!r} is a head that reads the features of a target with lm_head fingerprint "
            f"{draft.feature_fingerprint} and hidden size {draft.feature_size}; the target {target.model!r} has "
            f"{target.feature_fingerprint or 'no features'} and {target.feature_size}: serve the head's own target, "
            "on the lean runner"
        )
    limit = min(draft.max_draft_tokens, target.max_draft_tokens)
    if cfg.max_speculative_tokens > limit:
        raise ConfigError(
            f"--max-speculative-tokens {cfg.max_speculative_tokens} exceeds the servers' --max-draft-tokens {limit}"
        )


async def _connect(
    cfg: OrchestratorConfig, tokenizer
) -> tuple[ReplicaSet, ReplicaSet, ms_pb.ModelInfo, ms_pb.ModelInfo]:
    """The draft's and the target's replicas, once one of each has reported and the pair passed
    ``check_compatible``; returns them with those first reports. Raises ConfigError."""
    draft = ReplicaSet(
        Role.DRAFT,
        cfg.draft_address,
        lambda a: ModelClient(Role.DRAFT, a, draft_pb2_grpc.DraftServiceStub, cfg),
        cfg.resolve_interval_s,
    )
    target = ReplicaSet(
        Role.TARGET,
        cfg.target_address,
        lambda a: ModelClient(Role.TARGET, a, target_pb2_grpc.TargetServiceStub, cfg),
        cfg.resolve_interval_s,
    )
    log.info(
        "waiting up to %.0f s for the draft service at %s and the target service at %s",
        cfg.startup_timeout_s,
        cfg.draft_address,
        cfg.target_address,
    )
    draft_info, target_info = await asyncio.gather(
        _first_report(draft, cfg.startup_timeout_s), _first_report(target, cfg.startup_timeout_s)
    )
    check_compatible(cfg, tokenizer, draft_info, target_info)
    draft.fingerprint = target.fingerprint = target_info.tokenizer_fingerprint
    target.numerics = target_info.numerics
    if draft_info.reads_features:
        draft.reads_features, draft.feature_size = True, draft_info.feature_size
        draft.feature_fingerprint = target.feature_fingerprint = draft_info.feature_fingerprint
    return draft, target, draft_info, target_info


async def start_orchestrator(cfg: OrchestratorConfig, registry: CollectorRegistry, tokenizer=None):
    """Connect, check, bind; returns (server, port, health servicer, servicer). The OpenAI-compatible API, where
    --http-port is set, is servicer.http (an aiohttp runner on this loop)."""
    tokenizer = tokenizer or await asyncio.to_thread(models.load_tokenizer, cfg.tokenizer)
    draft, target, draft_info, target_info = await _connect(cfg, tokenizer)
    eos = set(target_info.eos_token_ids) | set(models.eos_token_ids(None, tokenizer))
    metrics = OrchestratorMetrics(registry, cfg.max_speculative_tokens)
    slots, kv_tokens = capacity(cfg, draft, target)  # the first replicas' until the others report
    servicer = GenerationServicer(
        cfg,
        tokenizer,
        draft,
        target,
        eos,
        min(draft_info.max_model_len, target_info.max_model_len),
        metrics,
        Admission(slots, kv_tokens, cfg.max_queued_requests),
    )
    server, port, health_servicer = create_server(
        f"{cfg.host}:{cfg.port}",
        [(generation_pb2_grpc.add_GenerationServicer_to_server, servicer, SERVICE_NAME)],
        max_receive_bytes=cfg.max_request_bytes,
        credentials=server_credentials(cfg),
    )
    await server.start()
    servicer.start()
    servicer.http = (
        await start_http(servicer, target_info.model, cfg.host, cfg.http_port, cfg.api_key) if cfg.http_port else None
    )
    await mark_serving(health_servicer, [SERVICE_NAME])
    log.info(
        "orchestrator listening on %s:%d (draft %s, target %s; %d generations and %d KV tokens at once, "
        "%d more requests in line)",
        cfg.host,
        port,
        draft_info.model,
        target_info.model,
        slots,
        kv_tokens,
        cfg.max_queued_requests,
    )
    return server, port, health_servicer, servicer


async def run_orchestrator(cfg: OrchestratorConfig) -> None:
    registry = CollectorRegistry()
    start_metrics(cfg.metrics_port, registry)
    server, _, health_servicer, servicer = await start_orchestrator(cfg, registry)
    health_server = await start_health_server(cfg.host, cfg.health_port, health_servicer)

    async def on_stop():
        if health_server is not None:
            await health_server.stop(0)
        if servicer.http is not None:
            await servicer.http.cleanup()  # after the grace period: the HTTP generations in flight had it too
        await servicer.close()

    await serve(server, health_servicer, cfg.grace_s, on_stop)
