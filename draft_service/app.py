"""Entry point of the draft service."""

from draft_service.servicer import DraftServicer
from specdec.model_server import ModelServer
from specdec.v1 import draft_pb2_grpc

SERVICE_NAME = "specdec.v1.DraftService"


def services(core: ModelServer) -> list[tuple]:
    return [(draft_pb2_grpc.add_DraftServiceServicer_to_server, DraftServicer(core), SERVICE_NAME)]
