"""Async client of the router, for the gateway.

The gateway calls :meth:`RouterClient.schedule` before Prefill and
:meth:`RouterClient.release` when a request ends (any way). Each call goes to
Serve's gRPC proxy with the ``application`` metadata that selects the router
app, and with the request id as Serve's ``session_id`` so that Schedule and
Release of one request reach the same router replica (percent-encoded where it is not plain ASCII:
:func:`metadata_value`). gRPC failures come back
as tandem.common.errors (see :func:`tandem.common.router_wire.error_from_status`).
With TLS settings enabled the call goes over mutual TLS to the router's TLS
front (``tandem.router.tls_front``), which forwards it to the proxy; after the
certificate files change, the next call dials a new channel with them.

Imports only grpc, tandem.common and tandem.v1 (no Ray): the gateway loads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from types import TracebackType
from urllib.parse import quote

import grpc
import grpc.aio

from tandem.common.errors import TandemError
from tandem.common.router_wire import (
    APPLICATION_NAME,
    METADATA_APPLICATION,
    METADATA_PRIORITY,
    METADATA_REQUEST_ID,
    METADATA_SESSION_ID,
    error_from_status,
)
from tandem.common.tls import CredentialFiles, TLSSettings, aio_channel
from tandem.v1 import router_pb2, router_pb2_grpc

#: A channel replaced after a certificate rotation is closed this long after, so that calls on it end.
_RETIRED_CHANNEL_GRACE_S = 30.0


def metadata_value(request_id: str) -> str:
    """``request_id`` as a gRPC metadata value, which may hold printable ASCII only (grpc refuses anything
    else client-side, before the call): percent-encoded (UTF-8) past RFC 3986's unreserved characters, so the
    gateway's own ids (``chatcmpl-`` and hex) go as they are, and one id always gives the same value (Schedule
    and Release reach the same replica). The request's messages carry the id itself."""
    return quote(request_id, safe="")


class RouterClient:
    """One channel to the router's gRPC address (host:port), shared by all requests."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 2.0,
        application: str = APPLICATION_NAME,
        tls: TLSSettings | None = None,
    ) -> None:
        self._address = address
        self._timeout_s = timeout_s
        self._application = application
        self._tls = tls if tls is not None else TLSSettings()
        self._files = CredentialFiles(self._tls)
        self._channel = aio_channel(address, self._tls)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._retiring: set[asyncio.Task[None]] = set()

    def _current_stub(self) -> router_pb2_grpc.RouterStub:
        if self._files.changed():
            old, self._channel = self._channel, aio_channel(self._address, self._tls)
            self._stub = router_pb2_grpc.RouterStub(self._channel)
            task = asyncio.ensure_future(old.close(grace=_RETIRED_CHANNEL_GRACE_S))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return self._stub

    @property
    def address(self) -> str:
        return self._address

    def _metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        session = metadata_value(request_id)
        return (
            (METADATA_APPLICATION, self._application),
            (METADATA_SESSION_ID, session),
            (METADATA_REQUEST_ID, session),
        )

    async def schedule(
        self,
        request_id: str,
        model: str,
        *,
        num_prompt_tokens: int = 0,
        max_tokens: int = 0,
        tenant: str = "",
        prompt_token_ids: Iterable[int] = (),
        cache_salt: str = "",
        exclude_worker_ids: Iterable[str] = (),
        priority: int | str = 0,
        prompt_block_hashes: Iterable[router_pb2.PromptBlockHashes] = (),
        prefill_done_on_worker_id: str = "",
        local_prefill_only: bool = False,
        adapter: str = "",
    ) -> router_pb2.Placement:
        """A (prefill, decode) pair for the request, reserved until :meth:`release` or the lease ends.

        ``num_prompt_tokens`` defaults to ``len(prompt_token_ids)``. The gateway sends
        ``prompt_block_hashes`` and no token ids (prompts do not travel to the router). ``priority``
        is the admission priority: an int (larger is served first, 1 = lowest
        class; 0 = not set) or a class name; it travels as ``tandem-priority``
        metadata. ``prefill_done_on_worker_id`` asks for a decode worker only (a dead decode worker's
        replacement): the prefill already ran on that worker, which holds the KV; the router reserves
        decode budget only and the placement's prefill names that worker. ``local_prefill_only`` asks
        for a decode worker that prefills the prompt itself (a local prefill's replacement): decode
        budget only, and the placement is a local prefill. ``adapter``: the request's LoRA adapter as its
        engine name (``NAME@VERSION``, tandem.common.adapters), "" for the base model; the router places
        it only on workers with adapter slots. A second Schedule of one request id replaces
        its earlier reservation.

        Raises NoCapacityError (no worker now; retry later), InvalidRequestError
        (``code="model_not_found"`` for a model no worker serves) or
        BackendUnavailableError (the router is unreachable).
        """
        token_ids = list(prompt_token_ids)
        request = router_pb2.ScheduleRequest(
            request_id=request_id,
            model=model,
            num_prompt_tokens=num_prompt_tokens or len(token_ids),
            max_tokens=max_tokens,
            tenant=tenant,
            prompt_token_ids=token_ids,
            cache_salt=cache_salt,
            exclude_worker_ids=list(exclude_worker_ids),
            prompt_block_hashes=list(prompt_block_hashes),
            prefill_done_on_worker_id=prefill_done_on_worker_id,
            local_prefill_only=local_prefill_only,
            adapter=adapter,
        )
        try:
            placement: router_pb2.Placement = await self._current_stub().Schedule(
                request,
                timeout=self._timeout_s,
                metadata=self._metadata(request_id) + (((METADATA_PRIORITY, str(priority)),) if priority else ()),
            )
        except grpc.aio.AioRpcError as exc:
            raise _map_rpc_error(exc) from exc
        return placement

    async def release(self, request_id: str) -> bool:
        """Release the request's reservation; False when the router had none (idempotent)."""
        try:
            response: router_pb2.RouterReleaseResponse = await self._current_stub().Release(
                router_pb2.RouterReleaseRequest(request_id=request_id),
                timeout=self._timeout_s,
                metadata=self._metadata(request_id),
            )
        except grpc.aio.AioRpcError as exc:
            raise _map_rpc_error(exc) from exc
        return bool(response.found)

    async def aclose(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _map_rpc_error(exc: grpc.aio.AioRpcError) -> TandemError:
    try:
        trailers = list(exc.trailing_metadata() or ())
    except Exception:  # a broken trailer must not hide the real error
        trailers = []
    return error_from_status(exc.code(), exc.details() or "", trailers)
