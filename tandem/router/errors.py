"""Errors the router returns to clients: a status code (named like gRPC's, so the servicer maps
by name without this module importing grpc) and a message that starts with the field at fault."""

from __future__ import annotations

from enum import Enum

from tandem.router.dispatch import (
    CapacityExceeded,
    DeadlineExceeded,
    DispatchError,
    RequestFailed,
    RequestRejected,
    TransferFailed,
    WorkerUnavailable,
)


class Code(str, Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    INTERNAL = "INTERNAL"


class RouterError(Exception):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message

    def __repr__(self) -> str:
        return f"RouterError({self.code.value}, {self.message!r})"


def invalid(message: str) -> RouterError:
    return RouterError(Code.INVALID_ARGUMENT, message)


def from_dispatch_error(exc: DispatchError) -> RouterError:
    if isinstance(exc, (WorkerUnavailable, TransferFailed)):
        return RouterError(Code.UNAVAILABLE, str(exc))
    if isinstance(exc, DeadlineExceeded):
        return RouterError(Code.DEADLINE_EXCEEDED, str(exc))
    if isinstance(exc, CapacityExceeded):
        return RouterError(Code.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, RequestRejected):
        return RouterError(Code.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, RequestFailed):  # this request only; the worker stays healthy
        return RouterError(Code.INTERNAL, str(exc))
    return RouterError(Code.INTERNAL, f"dispatch: {exc}")
