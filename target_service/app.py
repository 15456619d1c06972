"""Entry point of the target service."""

from specdec.model_server import ModelServer
from specdec.v1 import target_pb2_grpc
from target_service.servicer import TargetServicer

SERVICE_NAME = "specdec.v1.TargetService"


def services(core: ModelServer) -> list[tuple]:
    return [(target_pb2_grpc.add_TargetServiceServicer_to_server, TargetServicer(core), SERVICE_NAME)]
