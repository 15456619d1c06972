"""Stubs to the model servers, retried while a server is unreachable.

A generation talks to each server over one bidirectional stream (``Duplex``):
a round's ProposeTokens or Verify is then one message each way on a warm
stream, instead of a new call with its own set-up. Unary calls remain for the
rare RPCs (GetDistribution, ReleaseSession) and for clients without streams.
"""

from __future__ import annotations

import asyncio

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
    options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", cfg.upstream_tls_name)]
                                 if cfg.upstream_tls_name else [])
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

    async def call(self, method: str, request, *, wait_s: float | None = None):
        """One unary RPC; UNAVAILABLE is retried (see ``retrying``)."""
        rpc = getattr(self.stub, method)
        return await self.retrying(lambda: rpc(request, timeout=self.cfg.rpc_timeout_s), wait_s)

    async def retrying(self, attempt, wait_s: float | None = None):
        """await attempt(), retried with backoff while it fails UNAVAILABLE, for up to wait_s
        (default: the configured wait)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.cfg.unavailable_retry_s if wait_s is None else wait_s)
        delay = 0.05
        while True:
            try:
                return await attempt()
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or loop.time() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    async def close(self) -> None:
        await self.channel.close()


class Unary:
    """``Duplex``'s interface over unary calls (``rpc_streams = false``)."""

    def __init__(self, client: ModelClient, method: str):
        self.client = client
        self.method = method

    async def call(self, request, *, wait_s: float | None = None):
        return await self.client.call(self.method, request, wait_s=wait_s)

    def close(self) -> None:
        pass


class Duplex:
    """A bidirectional stream used as a sequence of calls: ``call`` writes one request and reads
    its response. Errors surface as ``AioRpcError`` with the server's status, exactly as a unary
    call's would; a broken stream is dropped and the next call opens a fresh one."""

    # A stream torn down under a message (a server stopped or killed) may end INTERNAL, UNKNOWN or
    # CANCELLED rather than UNAVAILABLE. On a stream that already carried a call, these are taken as
    # UNAVAILABLE: the request goes again on a fresh stream, where a real error shows with its own code.
    # Resending is safe: the session cursor makes a request that did run answer FAILED_PRECONDITION.
    _BROKEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)

    def __init__(self, client: ModelClient, method: str):
        self.client = client
        self.method = method
        self._call = None
        self._answered = 0  # calls the current stream has answered

    async def call(self, request, *, wait_s: float | None = None):
        return await self.client.retrying(lambda: self._exchange(request), wait_s)

    async def _exchange(self, request):
        if self._call is None:
            self._call, self._answered = getattr(self.client.stub, self.method)(), 0
        call, reused = self._call, self._answered > 0
        try:
            response = await asyncio.wait_for(_write_read(call, request), self.client.cfg.rpc_timeout_s)
        except asyncio.TimeoutError:
            self.close()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer within {self.client.cfg.rpc_timeout_s:g} s") from None
        except grpc.aio.AioRpcError as e:
            self.close()
            raise self._reopenable(e.code(), e.details(), reused) from None
        except asyncio.InvalidStateError:  # the stream had ended; its status says why
            response = grpc.aio.EOF
        if response is grpc.aio.EOF:
            self._call = None
            code, details = await call.code(), await call.details()
            if code == grpc.StatusCode.OK:  # ended without an error: the server went away cleanly
                code, details = grpc.StatusCode.UNAVAILABLE, "the server closed the stream"
            raise self._reopenable(code, details, reused)
        self._answered += 1
        return response

    def _reopenable(self, code: grpc.StatusCode, details: str, reused: bool) -> grpc.aio.AioRpcError:
        if reused and code in self._BROKEN:
            return rpc_error(grpc.StatusCode.UNAVAILABLE, f"the stream broke ({code.name}: {details})")
        return rpc_error(code, details)

    def close(self) -> None:
        """Drop the stream; the server frees its side at once."""
        if self._call is not None:
            self._call.cancel()
            self._call = None


async def _write_read(call, request):
    await call.write(request)
    return await call.read()
