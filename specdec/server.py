"""gRPC server plumbing shared by all three services.

``create_server`` binds (port 0 picks a free one) and adds the standard health
service and reflection; ``serve`` runs until SIGTERM or SIGINT, then flips
health to NOT_SERVING, stops accepting and gives in-flight calls a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback (for tests and the benchmark's services)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def up_environment(ports: list[int], host: str = "127.0.0.1") -> dict[str, str]:
    """The environment that puts `specdec up`'s services on ports (orchestrator, draft, target, their metrics
    ports in that order, the HTTP API), the orchestrator calling the model servers at host."""
    o, d, t, om, dm, tm, oh = ports
    return {
        "SPECDEC_ORCHESTRATOR_PORT": str(o),
        "SPECDEC_DRAFT_PORT": str(d),
        "SPECDEC_TARGET_PORT": str(t),
        "SPECDEC_ORCHESTRATOR_METRICS_PORT": str(om),
        "SPECDEC_DRAFT_METRICS_PORT": str(dm),
        "SPECDEC_TARGET_METRICS_PORT": str(tm),
        "SPECDEC_ORCHESTRATOR_HTTP_PORT": str(oh),
        "SPECDEC_ORCHESTRATOR_DRAFT_ADDRESS": f"{host}:{d}",
        "SPECDEC_ORCHESTRATOR_TARGET_ADDRESS": f"{host}:{t}",
    }


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cfg) -> grpc.ServerCredentials | None:
    """TLS from cfg's --tls-cert and --tls-key, requiring client certificates signed by --tls-client-ca where it
    is set (mutual TLS); None: plaintext."""
    if not cfg.tls_cert:
        return None
    ca = _read(cfg.tls_client_ca) if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(cfg.tls_key), _read(cfg.tls_cert))], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS to a server whose certificate ca signed, presenting cert and key where given (mutual TLS)."""
    return grpc.ssl_channel_credentials(_read(ca), _read(key) if key else None, _read(cert) if cert else None)


def create_server(
    address: str,
    services: list[tuple[Callable, object, str]],
    *,
    max_receive_bytes: int = 8 << 20,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """services: (add_XServicer_to_server, servicer, full service name); credentials: TLS (server_credentials),
    None for plaintext. Returns (server, port, health)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ]
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = []
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return server, port, health_servicer


async def start_health_server(host: str, port: int, health_servicer) -> grpc.aio.Server | None:
    """A plaintext server of grpc.health.v1 alone, sharing the main server's statuses: for probes that cannot
    speak TLS (Kubernetes' gRPC probes) where the main port requires it. Port 0: none."""
    if not port:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    return server


async def mark_serving(health_servicer, names: list[str]) -> None:
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def start_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0"):
    """Serve /metrics over HTTP; port 0 disables it."""
    if port:
        return start_http_server(port, addr=host, registry=registry)
    return None


async def serve(
    server: grpc.aio.Server,
    health_servicer,
    grace_s: float,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    stop_event: asyncio.Event | None = None,
    on_draining: Callable[[], None] | None = None,
) -> None:
    """Run a started server until a signal (or stop_event), then shut down gracefully.

    on_draining runs as shutdown begins, before the grace period; on_stop after it."""
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread (tests)
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: NOT_SERVING, draining for up to %.0f s", grace_s)
    await health_servicer.enter_graceful_shutdown()
    if on_draining is not None:
        on_draining()
    await server.stop(grace_s)
    if on_stop is not None:
        await on_stop()
