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
from tandem.router.deployment import schedule_request_from_proto
from tandem.v1 import router_pb2


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


def test_schedule_request_decodes_prefill_done_on_worker_id() -> None:
    """The deployment hands the scheduler a decode-only request as the gateway sent it."""
    proto = router_pb2.ScheduleRequest(
        request_id="r1", model="m", num_prompt_tokens=9, exclude_worker_ids=["d0"], prefill_done_on_worker_id="p0"
    )
    request = schedule_request_from_proto(proto, priority="batch")
    assert request.prefill_done_on_worker_id == "p0"
    assert request.exclude_worker_ids == frozenset({"d0"})
    assert (request.request_id, request.num_tokens, request.priority) == ("r1", 9, "batch")
    normal = schedule_request_from_proto(router_pb2.ScheduleRequest(request_id="r2", model="m"))
    assert normal.prefill_done_on_worker_id == ""
    assert not normal.local_prefill_only
    local = schedule_request_from_proto(router_pb2.ScheduleRequest(request_id="r3", model="m", local_prefill_only=True))
    assert local.local_prefill_only
