"""The gateway's seam to the router.

The orchestrator calls a :class:`Scheduler`; :func:`connect_scheduler` builds
the real one at startup by wrapping ``tandem.common.router_client.RouterClient`` (the
router team's client: it adds the Ray Serve proxy metadata and maps gRPC
statuses to tandem errors). Tests pass fakes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from tandem.v1 import router_pb2

logger = logging.getLogger(__name__)


class Scheduler(Protocol):
    """Places requests on a (prefill, decode) worker pair.

    ``schedule`` reserves budget on both workers and may wait in the router's
    admission queue; it raises NoCapacityError (queue timeout),
    BackendUnavailableError (router unreachable) or InvalidRequestError.
    ``release`` ends the reservation; it is idempotent and the gateway calls it
    once per placement, however the request ended (a prefill retry makes a
    second placement under the same request id, after releasing the first).
    """

    async def schedule(
        self,
        request_id: str,
        model: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        tenant: str,
        cache_salt: str,
        exclude_worker_ids: Sequence[str],
        priority: str = "",
    ) -> router_pb2.Placement: ...

    async def release(self, request_id: str) -> None: ...


class ClosableScheduler(Scheduler, Protocol):
    async def aclose(self) -> None: ...


class RouterClientScheduler:
    """Adapter over ``tandem.common.router_client.RouterClient`` ."""

    def __init__(self, client: Any) -> None:
        self._client = client

    async def schedule(
        self,
        request_id: str,
        model: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        tenant: str,
        cache_salt: str,
        exclude_worker_ids: Sequence[str],
        priority: str = "",
    ) -> router_pb2.Placement:
        placement: router_pb2.Placement = await self._client.schedule(
            request_id=request_id,
            model=model,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            tenant=tenant,
            cache_salt=cache_salt,
            exclude_worker_ids=list(exclude_worker_ids),
            priority=priority,
        )
        return placement

    async def release(self, request_id: str) -> None:
        await self._client.release(request_id)

    async def aclose(self) -> None:
        close = getattr(self._client, "aclose", None) or getattr(self._client, "close", None)
        if close is not None:
            result = close()
            if hasattr(result, "__await__"):
                await result


def connect_scheduler(address: str, *, timeout_s: float) -> ClosableScheduler:
    """The production scheduler: the router's gRPC client (tandem.common; grpc only, no Ray)."""
    from tandem.common.router_client import RouterClient

    return RouterClientScheduler(RouterClient(address, timeout_s=timeout_s))
