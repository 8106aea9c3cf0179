"""The gateway's seam to the router.

The orchestrator calls a :class:`Router`; :func:`connect_router` builds the
real one at startup: ``tandem.common.router_client.RouterClient`` (grpc only,
no Ray; it adds the Ray Serve proxy metadata and maps gRPC statuses to Tandem
errors). Tests pass fakes (``tests.kit.gateway.FakeRouter``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from tandem.common.tls import TLSSettings
from tandem.v1 import router_pb2


class Router(Protocol):
    """Places requests on a (prefill, decode) worker pair.

    ``schedule`` reserves budget on both workers and may wait in the router's
    admission queue; it raises NoCapacityError (queue timeout),
    BackendUnavailableError (router unreachable) or InvalidRequestError.
    The prompt itself does not travel: only its length and its prefix-cache block hashes
    (:mod:`tandem.gateway.prefix_hashes`). ``release`` ends the reservation; it is idempotent and the gateway calls it
    once per placement, however the request ended (a prefill retry makes a
    second placement under the same request id, after releasing the first).

    ``prefill_done_on_worker_id`` (a dead decode worker's replacement) asks for a decode worker
    only: the prefill already ran on that worker, which holds the KV. The gateway sends it without
    releasing first: a second Schedule of one request id replaces its earlier reservation in the
    router (the old pair's budget released, decode budget alone reserved, in one step).
    ``local_prefill_only`` (a local prefill's replacement) asks for a decode worker that prefills the
    prompt itself, with no prefill worker's budget booked. ``adapter``: the request's LoRA adapter by
    engine name (``NAME@VERSION``), "" for the base model; every Schedule of a request carries it.
    """

    async def schedule(
        self,
        request_id: str,
        model: str,
        *,
        num_prompt_tokens: int,
        prompt_block_hashes: Iterable[router_pb2.PromptBlockHashes],
        max_tokens: int,
        tenant: str,
        exclude_worker_ids: Iterable[str],
        priority: int | str,
        prefill_done_on_worker_id: str = "",
        local_prefill_only: bool = False,
        adapter: str = "",
    ) -> router_pb2.Placement: ...

    async def release(self, request_id: str) -> object: ...


class ClosableRouter(Router, Protocol):
    async def aclose(self) -> None: ...


def connect_router(address: str, *, timeout_s: float, tls: TLSSettings | None = None) -> ClosableRouter:
    """The production router client (over mutual TLS to the router's TLS front when ``tls`` is enabled)."""
    from tandem.common.router_client import RouterClient

    return RouterClient(address, timeout_s=timeout_s, tls=tls)
