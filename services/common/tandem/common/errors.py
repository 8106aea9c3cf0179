"""Tandem's error hierarchy.

    TandemError
    ├── RetryableError          the same request may succeed later or elsewhere
    │   ├── NoCapacityError     no worker can take the request now
    │   ├── WorkerUnavailableError  a worker did not answer / died
    │   └── BackendUnavailableError Redis or the router is down
    └── PermanentError          retrying the same request cannot help
        ├── InvalidRequestError bad input from the client
        └── KVLayoutMismatchError  two engines cannot exchange KV blocks

Library errors (gRPC, Redis, Ray) are mapped to these at the boundary.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base of all Tandem errors."""


class RetryableError(TandemError):
    """The same request may succeed later or on another worker."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoCapacityError(RetryableError):
    """No healthy worker with budget is available for this request."""


class WorkerUnavailableError(RetryableError):
    """A worker failed or could not be reached."""


class BackendUnavailableError(RetryableError):
    """A backing service (Redis, the router) is unreachable."""


class PermanentError(TandemError):
    """Retrying the same request cannot help."""


class InvalidRequestError(PermanentError):
    """The client's request is malformed or out of bounds."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class KVLayoutMismatchError(PermanentError):
    """Prefill and decode engines disagree on model, dtype or block layout."""
