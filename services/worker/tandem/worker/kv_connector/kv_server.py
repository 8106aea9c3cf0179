"""Prefill side of the worker-side connector: the one owner of held KV.

The scheduler-side connector announces each hold (blocks and lease expiry)
through the step metadata; this server keeps it until the decode engine
releases it (``Release``, after its pull), the worker service releases it
(an abort, by the caller's request id) or its lease expires, then reports the
request done sending so that vLLM frees the blocks. It serves
``tandem.v1.KVTransfer`` on its own threads: ``PullBlockBytes`` (raw bytes,
see :mod:`wire`), ``Release``, and ``Describe``/``GetStats`` for people and
tools."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from tandem.common import failpoints
from tandem.common.errors import KVLayoutMismatchError
from tandem.common.tls import TLSSettings, add_port
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import wire
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.params import external_request_id

logger = logging.getLogger(__name__)

_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # so_reuseport off: a port someone else holds must fail the bind, not share its traffic.
    ("grpc.so_reuseport", 0),
]
#: How long PullBlockBytes waits for a hold the scheduler has not announced yet.
_HOLD_ANNOUNCE_WAIT_S = 5.0


@dataclass
class Hold:
    block_ids: tuple[int, ...]
    expiry_unix_s: float


@dataclass
class ServeCounters:
    bytes_sent: int = 0
    blocks_sent: int = 0
    leases_expired: int = 0


class KVServer:
    """Holds and serves one engine rank's blocks on ``bind`` (``host:kv_port + rank``)."""

    def __init__(self, *, bind: str, tls: TLSSettings) -> None:
        self._bind = bind
        self._tls = tls
        self._lock = threading.Lock()
        self._hold_announced = threading.Condition(self._lock)
        self._holds: dict[str, Hold] = {}
        self._done_sending: set[str] = set()
        self._seen_finished: set[str] = set()
        self.counters = ServeCounters()
        self._caches: list[torch.Tensor] = []
        self._block_dim = 0
        self.layout: KVLayout | None = None
        self._server: grpc.Server | None = None

    def start(
        self,
        caches: list[torch.Tensor],
        block_dim: int,
        layout: KVLayout,
        stats: Callable[[], kv_transfer_pb2.KVStats],
    ) -> None:
        """Serve ``caches`` (one tensor per layer, in layer order); ``stats`` answers GetStats."""
        self._caches, self._block_dim, self.layout = caches, block_dim, layout
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tandem-kv-serve"),
            options=_SERVER_OPTIONS,
        )
        servicer = _KVTransferServicer(self, stats)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
        server.add_generic_rpc_handlers((servicer.pull_handler(),))
        if add_port(server, self._bind, self._tls) == 0:
            raise RuntimeError(f"KV transfer server cannot bind {self._bind}")
        server.start()
        self._server = server

    @property
    def address(self) -> str:
        """Where this rank's KV server listens (``host:port``)."""
        return self._bind

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0)

    # -- per step (engine loop) --------------------------------------------------

    def hold(self, holds: dict[str, tuple[tuple[int, ...], float]]) -> None:
        """Keep the blocks the scheduler-side connector announced this step."""
        if not holds:
            return
        with self._lock:
            for req_id, (block_ids, expiry) in holds.items():
                self._holds[req_id] = Hold(block_ids, expiry)
            self._hold_announced.notify_all()

    def take_done_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks vLLM may free now: released, or past their lease."""
        now = time.time()
        with self._lock:
            self._seen_finished |= finished_req_ids
            for req_id, hold in list(self._holds.items()):
                if hold.expiry_unix_s <= now:
                    del self._holds[req_id]
                    self._done_sending.add(req_id)
                    self.counters.leases_expired += 1
                    logger.warning("KV lease of %s expired before a decode engine released it", req_id)
            # vLLM only accepts ids it has already reported finished to us.
            sending = {r for r in self._done_sending if r in self._seen_finished}
            self._done_sending -= sending
            self._seen_finished -= sending
        return sending

    # -- serving (KV server threads, and the worker service through the engine) ---

    def wait_for_hold(self, req_id: str) -> Hold | None:
        deadline = time.monotonic() + _HOLD_ANNOUNCE_WAIT_S
        with self._lock:
            while req_id not in self._holds:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._hold_announced.wait(remaining)
            return self._holds[req_id]

    def release(self, req_id: str) -> bool:
        """Free the blocks held for ``req_id``: the handle's id (vLLM's internal request id), or the
        id the caller gave the request (what the worker service knows when it aborts one)."""
        with self._lock:
            if req_id not in self._holds:
                req_id = next((held for held in self._holds if external_request_id(held) == req_id), req_id)
            hold = self._holds.pop(req_id, None)
            if hold is not None:
                self._done_sending.add(req_id)
            return hold is not None

    def held(self) -> tuple[int, int]:
        """(requests, blocks) held now."""
        with self._lock:
            return len(self._holds), sum(len(h.block_ids) for h in self._holds.values())

    def read_chunks(self, block_ids: list[int], max_chunk_bytes: int) -> Iterator[bytes]:
        """All requested blocks as :mod:`wire` chunks, in wire order."""
        return wire.read_chunks(self._caches, self._block_dim, block_ids, max_chunk_bytes)

    def count_sent(self, num_bytes: int, num_blocks: int) -> None:
        with self._lock:
            self.counters.bytes_sent += num_bytes
            self.counters.blocks_sent += num_blocks


class _KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """gRPC face of :class:`KVServer`; runs on the KV server's threads."""

    def __init__(self, server: KVServer, stats: Callable[[], kv_transfer_pb2.KVStats]) -> None:
        self._kv = server
        self._stats = stats

    def Describe(self, request: kv_transfer_pb2.DescribeRequest, context: grpc.ServicerContext) -> common_pb2.KVLayout:
        assert self._kv.layout is not None
        return self._kv.layout.to_proto()

    def pull_handler(self) -> grpc.GenericRpcHandler:
        """``PullBlockBytes``: raw bytes out (see :mod:`wire`), so no response serializer."""
        _, service, method = wire.PULL_METHOD.split("/")
        return grpc.method_handlers_generic_handler(
            service,
            {
                method: grpc.unary_stream_rpc_method_handler(
                    self.pull_block_bytes, request_deserializer=kv_transfer_pb2.PullBlocksRequest.FromString
                )
            },
        )

    def pull_block_bytes(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        kv = self._kv
        assert kv.layout is not None
        try:
            kv.layout.check_compatible(KVLayout.from_proto(request.expected_layout))
        except KVLayoutMismatchError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        hold = kv.wait_for_hold(request.remote_request_id)
        if hold is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no KV held for {request.remote_request_id} (released, expired or never prefilled)",
            )
        assert hold is not None
        wanted = list(request.block_ids)
        if not set(wanted) <= set(hold.block_ids):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks {sorted(set(wanted) - set(hold.block_ids))} are not held for this request",
            )
        failpoints.hit("kv_server.before_pull")
        max_chunk = request.max_chunk_bytes or 4 * 1024 * 1024
        total = 0
        for chunk in kv.read_chunks(wanted, max_chunk):
            total += len(chunk)
            yield chunk
        kv.count_sent(total, len(wanted))

    def Release(
        self, request: kv_transfer_pb2.ReleaseBlocksRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.ReleaseBlocksResponse:
        return kv_transfer_pb2.ReleaseBlocksResponse(found=self._kv.release(request.remote_request_id))

    def GetStats(
        self, request: kv_transfer_pb2.KVStatsRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.KVStats:
        return self._stats()
