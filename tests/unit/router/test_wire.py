from __future__ import annotations

import grpc
import pytest

from tandem.common.errors import (
    BackendUnavailableError,
    InvalidRequestError,
    NoCapacityError,
    TandemError,
    WorkerUnavailableError,
)
from tandem.common.router_wire import TRAILER_ERROR, RouterInternalError, error_from_status, status_for_error


@pytest.mark.parametrize(
    "error,code",
    [
        (InvalidRequestError("nope", param="model", code="model_not_found"), grpc.StatusCode.NOT_FOUND),
        (InvalidRequestError("bad", code="invalid_request"), grpc.StatusCode.INVALID_ARGUMENT),
        (NoCapacityError("full", retry_after_s=2.5), grpc.StatusCode.UNAVAILABLE),
        (BackendUnavailableError("redis down"), grpc.StatusCode.UNAVAILABLE),
        (WorkerUnavailableError("gone"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_errors_round_trip_through_status_and_trailers(error: TandemError, code: grpc.StatusCode) -> None:
    status, trailers = status_for_error(error)
    assert status == code
    back = error_from_status(status, str(error), trailers)
    assert type(back) is type(error)
    if isinstance(error, InvalidRequestError):
        assert isinstance(back, InvalidRequestError) and back.code == error.code


def test_retry_after_travels_in_a_trailer() -> None:
    _, trailers = status_for_error(NoCapacityError("full", retry_after_s=2.5))
    back = error_from_status(grpc.StatusCode.UNAVAILABLE, "full", trailers)
    assert isinstance(back, NoCapacityError) and back.retry_after_s == 2.5


def test_unavailable_without_trailer_means_router_unreachable() -> None:
    err = error_from_status(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", [])
    assert isinstance(err, BackendUnavailableError)


def test_serve_backpressure_is_no_capacity() -> None:
    err = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", None)
    assert isinstance(err, NoCapacityError)


def test_serve_app_not_found_is_backend_unavailable_not_model_not_found() -> None:
    err = error_from_status(grpc.StatusCode.NOT_FOUND, "Application 'tandem-router' not found.", [])
    assert isinstance(err, BackendUnavailableError)


def test_bytes_trailers_are_decoded() -> None:
    err = error_from_status(grpc.StatusCode.NOT_FOUND, "x", [(TRAILER_ERROR, b"model_not_found")])
    assert isinstance(err, InvalidRequestError) and err.code == "model_not_found"


def test_unexpected_status_is_a_permanent_router_error() -> None:
    assert isinstance(error_from_status(grpc.StatusCode.INTERNAL, "boom", []), RouterInternalError)


def test_replica_died_under_the_call_is_retryable() -> None:
    """Serve's proxy maps RayActorError to INTERNAL: the router replica died, another takes the retry."""
    message = "The actor died unexpectedly before finishing this task.\n\tclass_name: ServeReplica:tandem-router:Router"
    err = error_from_status(grpc.StatusCode.INTERNAL, message, [])
    assert isinstance(err, BackendUnavailableError)


def test_internal_from_the_router_itself_stays_permanent() -> None:
    """The same words in an INTERNAL the router's own code raised (with its trailer) are not a lost replica."""
    err = error_from_status(grpc.StatusCode.INTERNAL, "The actor died unexpectedly", [(TRAILER_ERROR, "internal")])
    assert isinstance(err, RouterInternalError)
