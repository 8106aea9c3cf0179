"""What travels next to the tandem.v1.Router messages: gRPC metadata keys and
the mapping between tandem.common.errors and gRPC status codes.

Both ends use it: :mod:`tandem.router.deployment` turns errors into a status
code plus a ``tandem-error`` trailer, :mod:`tandem.common.router_client` turns them
back. The trailer is what tells "the router answered: no capacity" apart from
"the router (or Serve's proxy) is unreachable", which both arrive as
UNAVAILABLE. Imports only grpc and tandem.common: the gateway loads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc

from tandem.common.errors import (
    BackendUnavailableError,
    InvalidRequestError,
    NoCapacityError,
    PermanentError,
    RetryableError,
    TandemError,
    WorkerUnavailableError,
)

#: Ray Serve application name of the router.
APPLICATION_NAME = "tandem-router"

#: Metadata Serve's gRPC proxy reads: which application, and the routing key
#: that keeps Schedule and Release of one request on one router replica.
METADATA_APPLICATION = "application"
METADATA_SESSION_ID = "session_id"
METADATA_REQUEST_ID = "request_id"
#: Admission priority class of the request (the router's queue serves classes in order).
METADATA_PRIORITY = "tandem-priority"

#: Trailers the router sets on errors.
TRAILER_ERROR = "tandem-error"
TRAILER_RETRY_AFTER_S = "tandem-retry-after-s"

ERROR_MODEL_NOT_FOUND = "model_not_found"
ERROR_INVALID_REQUEST = "invalid_request"
ERROR_NO_CAPACITY = "no_capacity"
ERROR_BACKEND_UNAVAILABLE = "backend_unavailable"
ERROR_WORKER_UNAVAILABLE = "worker_unavailable"
ERROR_INTERNAL = "internal"


def error_kind(exc: TandemError) -> str:
    """The ``tandem-error`` trailer value for ``exc``."""
    if isinstance(exc, InvalidRequestError):
        return ERROR_MODEL_NOT_FOUND if exc.code == ERROR_MODEL_NOT_FOUND else ERROR_INVALID_REQUEST
    if isinstance(exc, NoCapacityError):
        return ERROR_NO_CAPACITY
    if isinstance(exc, BackendUnavailableError):
        return ERROR_BACKEND_UNAVAILABLE
    if isinstance(exc, WorkerUnavailableError):
        return ERROR_WORKER_UNAVAILABLE
    return ERROR_INTERNAL


_STATUS_BY_KIND = {
    ERROR_MODEL_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ERROR_INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ERROR_NO_CAPACITY: grpc.StatusCode.UNAVAILABLE,
    ERROR_BACKEND_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ERROR_WORKER_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ERROR_INTERNAL: grpc.StatusCode.INTERNAL,
}


def status_for_error(exc: TandemError) -> tuple[grpc.StatusCode, list[tuple[str, str]]]:
    """The status code and trailers the router answers ``exc`` with."""
    kind = error_kind(exc)
    trailers = [(TRAILER_ERROR, kind)]
    if isinstance(exc, RetryableError):
        trailers.append((TRAILER_RETRY_AFTER_S, f"{exc.retry_after_s:g}"))
    return _STATUS_BY_KIND[kind], trailers


_UNREACHABLE_CODES: Sequence[grpc.StatusCode] = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    # Serve answers NOT_FOUND "Application ... not found" while the app is not deployed yet.
    grpc.StatusCode.NOT_FOUND,
)


# Serve's proxy answers INTERNAL, with the str() of Ray's RayActorError, when the
# replica serving a call died or became unreachable mid-call (ray/serve/_private/
# grpc_util.py): another replica can take the retry.
_REPLICA_LOST_MARKERS: Sequence[str] = (
    "The actor died unexpectedly",  # ActorDiedError
    "The actor died because",  # ActorDiedError, with the cause
    "The actor experienced an error before finishing",  # RayActorError
    "The task may or may not have been executed",  # ActorUnavailableError
)


class RouterInternalError(PermanentError):
    """The router failed in a way retrying will not fix (a bug, or a contract mismatch)."""


def _float_or(raw: str | None, default: float) -> float:
    try:
        return float(raw) if raw is not None else default
    except ValueError:
        return default


def error_from_status(
    code: grpc.StatusCode, details: str, trailers: Iterable[tuple[str, str | bytes]] | None
) -> TandemError:
    """The tandem error for a failed router call (the inverse of :func:`status_for_error`).

    Without a ``tandem-error`` trailer the status came from gRPC or Serve's
    proxy rather than from the router's code: UNAVAILABLE and DEADLINE_EXCEEDED
    then mean the router is unreachable, RESOURCE_EXHAUSTED is Serve's
    backpressure (the router is saturated), and INTERNAL naming a dead actor
    means the replica died under the call (retryable on another replica).
    """
    meta = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in (trailers or ())}
    kind = meta.get(TRAILER_ERROR)
    retry_after_s = _float_or(meta.get(TRAILER_RETRY_AFTER_S), 1.0)
    message = details or code.name
    if kind == ERROR_MODEL_NOT_FOUND or (
        kind is None and code == grpc.StatusCode.NOT_FOUND and "Application" not in message
    ):
        return InvalidRequestError(message, param="model", code=ERROR_MODEL_NOT_FOUND)
    if kind == ERROR_INVALID_REQUEST or (kind is None and code == grpc.StatusCode.INVALID_ARGUMENT):
        return InvalidRequestError(message, code=ERROR_INVALID_REQUEST)
    if kind == ERROR_NO_CAPACITY or (kind is None and code == grpc.StatusCode.RESOURCE_EXHAUSTED):
        return NoCapacityError(message, retry_after_s=retry_after_s)
    if kind == ERROR_WORKER_UNAVAILABLE:
        return WorkerUnavailableError(message, retry_after_s=retry_after_s)
    if kind == ERROR_BACKEND_UNAVAILABLE or code in _UNREACHABLE_CODES:
        return BackendUnavailableError(f"router unavailable: {message}", retry_after_s=retry_after_s)
    if kind is None and code == grpc.StatusCode.INTERNAL and any(m in message for m in _REPLICA_LOST_MARKERS):
        return BackendUnavailableError(f"router unavailable: {message}", retry_after_s=retry_after_s)
    return RouterInternalError(f"router failed: {code.name}: {message}")
