"""What a client is told of a server-side failure names nothing inside: no worker address, no gRPC
detail, no exception class; the log keeps the detail with the request id. The client's own errors
keep their message."""

from __future__ import annotations

import logging

import grpc
import pytest

from tandem.common.errors import (
    BackendUnavailableError,
    InvalidRequestError,
    KVLayoutMismatchError,
    NoCapacityError,
    PermanentError,
    WorkerUnavailableError,
)
from tandem.gateway.api.errors import PUBLIC_MESSAGES, api_error_from
from tandem.gateway.workers import map_worker_error

INSIDE = (
    "decode worker 127.0.0.1:50052: UNKNOWN: Unexpected <class "
    "'vllm.v1.engine.exceptions.EngineDeadError'>: EngineCore encountered an issue"
)


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    "exc",
    [
        WorkerUnavailableError(INSIDE),
        BackendUnavailableError("worker registry unreachable: Error 111 connecting to 10.0.3.7:6379"),
        NoCapacityError(f"no decode worker: {INSIDE}"),
        PermanentError(INSIDE),
        KVLayoutMismatchError("prefill-host-1 float32 vs decode-host-2 bfloat16"),
        map_worker_error(_RpcError(grpc.StatusCode.UNKNOWN, INSIDE), role="decode", address="127.0.0.1:50052"),
        map_worker_error(_RpcError(grpc.StatusCode.UNAVAILABLE, INSIDE), role="decode", address="127.0.0.1:50052"),
        map_worker_error(_RpcError(grpc.StatusCode.INTERNAL, ""), role="prefill", address="10.1.2.3:50051"),
    ],
)
def test_server_side_errors_reach_the_client_as_fixed_text_and_the_log_keeps_the_detail(
    exc: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tandem.gateway.api.errors"):
        error = api_error_from(exc, request_id="chatcmpl-abc")  # type: ignore[arg-type]
    assert error.status_code in (502, 503)
    assert error.message in PUBLIC_MESSAGES.values()
    text = str(error.body())
    for secret in ("127.0.0.1", "10.", "Error", "class", "vllm", "UNKNOWN", "host"):
        assert secret not in text, (secret, text)
    (record,) = caplog.records
    assert record.request_id == "chatcmpl-abc" and str(exc) in record.getMessage()  # type: ignore[attr-defined]


def test_the_clients_own_errors_keep_their_message() -> None:
    error = api_error_from(InvalidRequestError("max_tokens must be at least 1", param="max_tokens"))
    assert (error.status_code, error.message, error.param) == (400, "max_tokens must be at least 1", "max_tokens")
    refused = map_worker_error(
        _RpcError(grpc.StatusCode.INVALID_ARGUMENT, ""), role="decode", address="127.0.0.1:50052"
    )
    assert "127.0.0.1" not in api_error_from(refused).message
