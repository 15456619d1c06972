"""Errors that carry the gRPC status telling the caller what to do."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)
