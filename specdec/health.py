"""Asking a server's grpc.health.v1 service how it is, with grpc alone.

Container health checks run this every few seconds (``specdec health``), so it imports neither torch nor
the rest of specdec.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_status(address: str, service: str = "", timeout: float = 3.0) -> str:
    """SERVING, NOT_SERVING... or the gRPC status code's name when the server does not answer."""
    try:
        with grpc.insecure_channel(address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as e:
        return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
