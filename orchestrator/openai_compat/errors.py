"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, and the HTTP status of each gRPC one."""

from __future__ import annotations

import grpc

from specdec.errors import ServiceError

_STATUS = {  # gRPC status -> (HTTP status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    @classmethod
    def of(cls, e: ServiceError) -> ApiError:
        status, kind = _STATUS.get(e.code, (500, "internal_error"))
        return cls(status, e.message, kind, code=e.code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    """400 for a body that does not say what it means; `param` names the field."""
    return ApiError(400, message, param=param)


def unsupported(param: str, what: str = "") -> ApiError:
    """400 for a field this server does not serve (yet): refused by name rather than dropped."""
    return ApiError(
        400, f"{param}{' ' + what if what else ''} is not supported by this server", param=param, code="unsupported"
    )
