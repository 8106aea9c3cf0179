"""gRPC channels to the workers, one per address, and the mapping of worker
gRPC errors into Tandem errors.

Called by the orchestrator; calls ``tandem.v1.Worker`` through grpc.aio, over
mutual TLS when the gateway's ``tls`` settings are enabled (the gateway
presents its certificate and checks the worker's against the CA; see
docs/security.md). Channels are created on first use and kept: workers come
and go, but an idle HTTP/2 connection is cheap and reconnects by itself. After
the certificate files change (a rotation), the next call dials new channels with
them; the old ones close once their calls had time to end.
"""

from __future__ import annotations

import asyncio

import grpc

from tandem.common.adapters import split_engine_name
from tandem.common.errors import (
    InvalidRequestError,
    KVLayoutMismatchError,
    NoCapacityError,
    PermanentError,
    TandemError,
    WorkerUnavailableError,
)
from tandem.common.tls import RECONNECT_BACKOFF_OPTIONS, CredentialFiles, TLSSettings, aio_channel
from tandem.gateway.errors import AdapterUnavailableError
from tandem.v1 import worker_pb2_grpc

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS: list[tuple[str, object]] = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    # Notice a dead worker during a long decode without waiting for the deadline.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted worker must not look dead to a channel still backing off from its predecessor.
    *RECONNECT_BACKOFF_OPTIONS,
]
#: Channels replaced after a certificate rotation close this long after (a decode stream on one ends first).
_RETIRED_CHANNEL_GRACE_S = 600.0


class WorkerChannels:
    """Cached grpc.aio channels and Worker stubs, keyed by ``host:port``; plaintext unless ``tls`` is enabled."""

    def __init__(self, tls: TLSSettings | None = None) -> None:
        self._tls = tls if tls is not None else TLSSettings()
        self._files = CredentialFiles(self._tls)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        if self._files.changed():
            self._retire()
        stub = self._stubs.get(address)
        if stub is None:
            channel = aio_channel(address, self._tls, options=_CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    def _retire(self) -> None:
        """Dial every worker anew (with the rotated files); close the old channels after a grace."""
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            task = asyncio.ensure_future(channel.close(grace=_RETIRED_CHANNEL_GRACE_S))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def aclose(self) -> None:
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            await channel.close()
        for task in list(self._retiring):
            task.cancel()


def map_worker_error(exc: grpc.aio.AioRpcError, *, role: str, address: str, adapter: str = "") -> TandemError:
    """A worker's gRPC status as a Tandem error (retryable or permanent). The message names the worker
    and its gRPC status, for the log; the client is told a fixed text (``api_error_from``), except for
    INVALID_ARGUMENT, whose details the worker writes for the client (what was out of bounds).

    A request with a LoRA ``adapter`` (its engine name): NOT_FOUND is the worker's "no such adapter
    (unloaded, or superseded by a reload) in the catalog": 404 ``model_not_found`` naming the adapter as
    the client did; FAILED_PRECONDITION (LoRA off there, its files failed to load, another model's
    adapter) is an :class:`AdapterUnavailableError`, 503 with Retry-After; RESOURCE_EXHAUSTED (every
    adapter slot busy) is no capacity, 503 with Retry-After, as for any request."""
    code = exc.code()
    where = f"{role} worker {address}: {code.name}: {exc.details()}"
    if adapter and code == grpc.StatusCode.NOT_FOUND:
        try:
            name = split_engine_name(adapter)[0]
        except ValueError:
            name = adapter
        return InvalidRequestError(f"The model `{name}` does not exist.", param="model", code="model_not_found")
    if adapter and code == grpc.StatusCode.FAILED_PRECONDITION:
        return AdapterUnavailableError(where)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NoCapacityError(where)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED):
        return WorkerUnavailableError(where)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return InvalidRequestError(exc.details() or f"the {role} worker refused the request")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return KVLayoutMismatchError(where)
    return PermanentError(where)
