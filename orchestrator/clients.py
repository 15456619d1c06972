"""Stubs to the model servers, retried while a server is unreachable."""

from __future__ import annotations

import asyncio

import grpc

from specdec.config import OrchestratorConfig

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


class ModelClient:
    def __init__(self, role: str, address: str, stub_cls, cfg: OrchestratorConfig):
        self.role = role
        self.address = address
        self.cfg = cfg
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = stub_cls(self.channel)

    async def call(self, method: str, request, *, wait_s: float | None = None):
        """One RPC; UNAVAILABLE is retried with backoff for up to wait_s (default: the configured wait)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.cfg.unavailable_retry_s if wait_s is None else wait_s)
        delay = 0.05
        while True:
            try:
                return await getattr(self.stub, method)(request, timeout=self.cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or loop.time() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    async def close(self) -> None:
        await self.channel.close()
