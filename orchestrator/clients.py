"""A channel and a stub to one model server, plaintext or TLS.

A call raises ``AioRpcError`` with the server's status and is never retried here: what a failed call leads
to is orchestrator/failover.py's. A generation's round calls ride a stream per server (orchestrator/link.py).
"""

from __future__ import annotations

import grpc

from specdec.config import OrchestratorConfig
from specdec.server import channel_credentials

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


def _channel(address: str, cfg: OrchestratorConfig) -> grpc.aio.Channel:
    """Plaintext, or TLS where --upstream-tls-ca is set (mutual with --upstream-tls-cert and --upstream-tls-key)."""
    if not cfg.upstream_tls_ca:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + (
        [("grpc.ssl_target_name_override", cfg.upstream_tls_name)] if cfg.upstream_tls_name else []
    )
    credentials = channel_credentials(cfg.upstream_tls_ca, cfg.upstream_tls_cert, cfg.upstream_tls_key)
    return grpc.aio.secure_channel(address, credentials, options=options)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class ModelClient:
    def __init__(self, role: str, address: str, stub_cls, cfg: OrchestratorConfig):
        self.role = role
        self.address = address
        self.cfg = cfg
        self.channel = _channel(address, cfg)
        self.stub = stub_cls(self.channel)

    async def call(self, method: str, request):
        """One unary RPC, within --rpc-timeout-s."""
        return await getattr(self.stub, method)(request, timeout=self.cfg.rpc_timeout_s)

    async def close(self) -> None:
        await self.channel.close()
