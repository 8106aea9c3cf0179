"""Gateway-only errors, under tandem.common.errors' tree::

    PermanentError
    ├── AuthenticationError     no, unknown or revoked key (401)
    ├── PermissionDeniedError   the tenant may not do this (403)
    └── StorageQuotaExceededError  what the request would store is over the tenant's storage quota (413)
    RetryableError
    ├── RateLimitedError        quota or concurrency cap reached (429, Retry-After, x-ratelimit-*)
    ├── ShuttingDownError       this replica is draining (503)
    └── AdapterUnavailableError a worker could not apply the request's LoRA adapter now (503, Retry-After)

Raised by the tenancy, quota, storage quota and drain modules and the worker error mapping; mapped to HTTP by
:func:`tandem.gateway.api.errors.api_error_from`.
"""

from __future__ import annotations

from tandem.common.errors import PermanentError, RetryableError


class AuthenticationError(PermanentError):
    pass


class PermissionDeniedError(PermanentError):
    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class StorageQuotaExceededError(PermanentError):
    """Retrying cannot help: the same request would store as much again (tandem.gateway.storage_quota)."""

    code = "storage_quota_exceeded"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RateLimitedError(RetryableError):
    """``kind`` is ``tokens`` or ``requests`` (OpenAI's error type); headers go to the client as they are."""

    def __init__(self, message: str, *, kind: str, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.kind = kind
        self.headers = headers


class ShuttingDownError(RetryableError):
    pass


class AdapterUnavailableError(RetryableError):
    """A worker refused the request's LoRA adapter for a reason a later try may not meet: LoRA off on the
    worker placed, the adapter's files failed to load there, or a reload raced the placement. The
    detail (worker address, gRPC details) is for the log only."""
