"""OpenAI-shaped error bodies and the mapping from Tandem errors to HTTP.

Called by the route handlers and the SSE writer; calls nothing. Every error a
client sees has the shape ``{"error": {"message", "type", "param", "code"}}``;
before a stream starts it comes with an HTTP status, after it has started it is
the stream's last event (see :mod:`tandem.gateway.sse`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from tandem.common.errors import (
    BackendUnavailableError,
    InvalidRequestError,
    NoCapacityError,
    RetryableError,
    TandemError,
    WorkerUnavailableError,
)
from tandem.gateway.errors import (
    AdapterUnavailableError,
    AuthenticationError,
    PermissionDeniedError,
    RateLimitedError,
    ShuttingDownError,
    StorageQuotaExceededError,
)

logger = logging.getLogger(__name__)

#: What a client is told of a failure on the server's side, by code. Fixed texts: the errors behind them
#: name workers' addresses, gRPC details, Redis hosts and engine exceptions, which stay in the log
#: (with the request id), never in a response.
PUBLIC_MESSAGES = {
    "no_capacity": "No worker can take this request now; retry after the Retry-After delay.",
    "backend_unavailable": "A service the gateway depends on is unavailable; retry after the Retry-After delay.",
    "worker_unavailable": "The model's workers are unavailable; retry after the Retry-After delay.",
    "unavailable": "The service is unavailable; retry after the Retry-After delay.",
    "upstream_error": "The model server failed to complete the request.",
    "adapter_unavailable": "The model's adapter cannot be applied now; retry after the Retry-After delay.",
}


@dataclass(frozen=True)
class ApiError:
    """An error as the client will see it."""

    status_code: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers or None)


class ModelNotFoundError(InvalidRequestError):
    """The client asked for a model this gateway does not serve (404)."""


class RequestTooLargeError(InvalidRequestError):
    """The request body is over the configured limit (413)."""


def api_error_from(exc: TandemError, *, request_id: str = "") -> ApiError:
    """Map a Tandem error to what the client sees. The client's own errors (4xx) keep their message,
    written for the client; a server-side error gets a fixed one (:data:`PUBLIC_MESSAGES`) and its
    detail goes to the log under ``request_id``."""
    if isinstance(exc, AuthenticationError):
        return ApiError(401, str(exc), code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="tandem"'})
    if isinstance(exc, PermissionDeniedError):
        return ApiError(403, str(exc), type="permission_error", param=exc.param, code=exc.code)
    if isinstance(exc, StorageQuotaExceededError):
        # 413, not 429: the OpenAI SDKs retry a 429 (and OpenAI's own 429 insufficient_quota is the
        # well-known trap of a retry loop that cannot succeed); retrying this request cannot help either.
        # Not 400: the request is well-formed, it is too large for what its tenant may store.
        return ApiError(413, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RateLimitedError):
        headers = {**exc.headers, "Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        return ApiError(429, str(exc), type=exc.kind, code="rate_limit_exceeded", headers=headers)
    if isinstance(exc, ShuttingDownError):
        return ApiError(
            503,
            str(exc),
            type="server_error",
            code="shutting_down",
            headers={"Retry-After": "1", "Connection": "close"},
        )
    if isinstance(exc, ModelNotFoundError) or (isinstance(exc, InvalidRequestError) and exc.code == "model_not_found"):
        return ApiError(404, str(exc), param=exc.param or "model", code=exc.code or "model_not_found")
    # The admin API's unload of an adapter; a stored response (api.response_chains).
    if isinstance(exc, InvalidRequestError) and exc.code in ("adapter_not_found", "response_not_found"):
        return ApiError(404, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RequestTooLargeError):
        return ApiError(413, str(exc), code=exc.code or "request_too_large")
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RetryableError):
        code = {
            NoCapacityError: "no_capacity",
            BackendUnavailableError: "backend_unavailable",
            WorkerUnavailableError: "worker_unavailable",
            AdapterUnavailableError: "adapter_unavailable",
        }.get(type(exc), "unavailable")
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        _log_detail(exc, code, request_id)
        return ApiError(
            503, PUBLIC_MESSAGES[code], type="server_error", code=code, headers={"Retry-After": retry_after}
        )
    _log_detail(exc, "upstream_error", request_id)
    return ApiError(502, PUBLIC_MESSAGES["upstream_error"], type="server_error", code="upstream_error")


def _log_detail(exc: TandemError, code: str, request_id: str) -> None:
    logger.warning("%s: %s", code, exc, extra={"request_id": request_id, "error_type": type(exc).__name__})


def internal_error() -> ApiError:
    """For bugs: no details leak to the client; the log has the traceback."""
    return ApiError(500, "The server had an internal error.", type="server_error", code="internal_error")
