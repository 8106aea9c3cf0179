"""Worker-side half of the gRPC KV connector; runs in vLLM's model-runner
process, next to the KV tensors.

It serves ``tandem.v1.KVTransfer`` (prefill: hand out held blocks; both:
describe layout, counters) and pulls blocks from a prefill engine into this
engine's paged cache (decode). vLLM calls ``register_kv_caches`` once, then
``start_load_kv`` and ``get_transfer_results`` every step; gRPC threads and a
small pull pool do the I/O so the engine loop never blocks on the network.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from tandem.common import failpoints
from tandem.common.errors import KVLayoutMismatchError
from tandem.common.tls import RECONNECT_BACKOFF_OPTIONS, TLSSettings, add_port
from tandem.common.tls import channel as tls_channel
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import heap, wire
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, LoadSpec
from tandem.worker.kv_connector.params import KVHandleParams, external_request_id

logger = logging.getLogger(__name__)

_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
#: Client channels to other engines' KV servers: a prefill worker restarted on the same address is
#: dialled again within two seconds (gRPC's default backoff grows to two minutes).
_CLIENT_OPTIONS = [*_GRPC_OPTIONS, *RECONNECT_BACKOFF_OPTIONS]
#: How long PullBlockBytes waits for a hold the scheduler has not announced yet.
_HOLD_ANNOUNCE_WAIT_S = 5.0
#: How long an idle engine step (nothing scheduled, loads in flight) waits for a load to finish.
#: vLLM steps an engine that has only requests waiting for KV in a tight Python loop; in the
#: process that also runs the pull, that loop kept the GIL from the pull's threads (a 118 MB
#: pull took 125-930 ms on the live stack, 65 ms without the loop). Waiting on a condition
#: gives the GIL to the pull; a request that arrives meanwhile is scheduled at most this late.
IDLE_STEP_WAIT_S = 0.01
_MAX_REQUEST_RECORDS = 4096


def _layer_sort_key(name: str) -> tuple[int, str]:
    match = re.search(r"\.(\d+)\.", name) or re.search(r"(\d+)", name)
    return (int(match.group(1)) if match else -1, name)


@dataclass
class _Hold:
    block_ids: tuple[int, ...]
    expiry_unix_s: float


@dataclass
class _Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    kv_tokens_loaded: int = 0
    transfer_seconds: float = 0.0
    loads_failed: int = 0
    leases_expired: int = 0
    requests: OrderedDict[str, kv_transfer_pb2.KVRequestStats] = field(default_factory=OrderedDict)


class WorkerSide:
    """KV server and puller for one engine rank."""

    def __init__(
        self,
        *,
        model: str,
        num_blocks: int,
        block_size_tokens: int,
        tp_size: int,
        tp_rank: int,
        kv_host: str,
        kv_port: int,
        max_chunk_bytes: int,
        pull_timeout_s: float,
        tls: TLSSettings | None = None,
    ) -> None:
        self._model = model
        self._num_blocks = num_blocks
        self._block_size_tokens = block_size_tokens
        self._tp_size = tp_size
        self._tp_rank = tp_rank
        self._bind = f"{kv_host}:{kv_port + tp_rank}"
        self._max_chunk_bytes = max_chunk_bytes
        self._pull_timeout_s = pull_timeout_s
        self._tls = tls or TLSSettings()
        heap.keep_message_buffers(max_chunk_bytes)

        self._lock = threading.Lock()
        self._hold_announced = threading.Condition(self._lock)
        self._load_finished = threading.Condition(self._lock)
        self._num_loads_in_flight = 0
        self._idle_step = False
        self._holds: dict[str, _Hold] = {}
        self._done_sending: set[str] = set()
        self._seen_finished: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._failed_block_ids: set[int] = set()
        self._counters = _Counters()

        self._layers: list[tuple[str, torch.Tensor]] = []
        self._block_dim = 0
        self.layout: KVLayout | None = None
        self._server: grpc.Server | None = None
        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="tandem-kv-pull")
        self._channels: dict[str, grpc.Channel] = {}

    # -- set-up ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Derive the block layout from the live tensors and start the KV server."""
        layers = sorted(kv_caches.items(), key=lambda kv: _layer_sort_key(kv[0]))
        first = layers[0][1]
        dims = [i for i, d in enumerate(first.shape) if d == self._num_blocks]
        if not dims:
            raise KVLayoutMismatchError(
                f"cannot find the block dimension ({self._num_blocks} blocks) in KV shape {tuple(first.shape)}"
            )
        self._block_dim = dims[0]
        for name, tensor in layers:
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise KVLayoutMismatchError(
                    f"layer {name} has KV shape {tuple(tensor.shape)} {tensor.dtype}, "
                    f"expected {tuple(first.shape)} {first.dtype}"
                )
        self._layers = layers
        block_shape = tuple(int(d) for i, d in enumerate(first.shape) if i != self._block_dim)
        self.layout = KVLayout(
            model=self._model,
            dtype=str(first.dtype).removeprefix("torch."),
            block_size_tokens=self._block_size_tokens,
            num_layers=len(layers),
            block_shape=block_shape,
            tp_size=self._tp_size,
            block_dim=self._block_dim,
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tandem-kv-serve"),
            # so_reuseport off: a port someone else holds must fail the bind, not share its traffic.
            options=[*_GRPC_OPTIONS, ("grpc.so_reuseport", 0)],
        )
        servicer = _KVTransferServicer(self)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
        server.add_generic_rpc_handlers((servicer.pull_handler(),))
        if add_port(server, self._bind, self._tls) == 0:
            raise RuntimeError(f"KV transfer server cannot bind {self._bind}")
        server.start()
        self._server = server
        logger.info(
            "KV transfer server ready on %s: %d layers, block %s %s, block dim %d of %s",
            self._bind,
            len(layers),
            block_shape,
            self.layout.dtype,
            self._block_dim,
            tuple(first.shape),
        )

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in self._channels.values():
            channel.close()

    # -- per step (engine loop) --------------------------------------------------

    def start_load_kv(self, meta: GrpcKVMetadata) -> None:
        with self._lock:
            for req_id, (block_ids, expiry) in meta.holds.items():
                self._holds[req_id] = _Hold(block_ids, expiry)
            if meta.holds:
                self._hold_announced.notify_all()
            self._num_loads_in_flight += len(meta.loads)
            self._idle_step = meta.idle_step
        for spec in meta.loads:
            self._pool.submit(self._load, spec)
        for handle in meta.releases:
            self._pool.submit(self._release_remote, handle)

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(done sending, done receiving, failed receiving) since the last call."""
        now = time.time()
        with self._lock:
            if self._idle_step and self._num_loads_in_flight and not (self._done_recving or self._failed_recving):
                self._load_finished.wait(IDLE_STEP_WAIT_S)
            self._seen_finished |= finished_req_ids
            for req_id, hold in list(self._holds.items()):
                if hold.expiry_unix_s <= now:
                    del self._holds[req_id]
                    self._done_sending.add(req_id)
                    self._counters.leases_expired += 1
                    logger.warning("KV lease of %s expired before a decode engine released it", req_id)
            # vLLM only accepts ids it has already reported finished to us.
            sending = {r for r in self._done_sending if r in self._seen_finished}
            self._done_sending -= sending
            self._seen_finished -= sending
            recving, self._done_recving = self._done_recving, set()
            failed, self._failed_recving = self._failed_recving, set()
        return sending, recving, failed

    def take_failed_block_ids(self) -> set[int]:
        with self._lock:
            ids, self._failed_block_ids = self._failed_block_ids, set()
        return ids

    # -- prefill side: serving ---------------------------------------------------

    def wait_for_hold(self, req_id: str) -> _Hold | None:
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

    def read_chunks(self, block_ids: list[int], max_chunk_bytes: int) -> Iterator[bytes]:
        """All requested blocks as :mod:`wire` chunks, in wire order."""
        return wire.read_chunks([cache for _, cache in self._layers], self._block_dim, block_ids, max_chunk_bytes)

    def count_sent(self, num_bytes: int, num_blocks: int) -> None:
        with self._lock:
            self._counters.bytes_sent += num_bytes
            self._counters.blocks_sent += num_blocks

    def stats(self, request_id: str) -> kv_transfer_pb2.KVStats:
        with self._lock:
            c = self._counters
            msg = kv_transfer_pb2.KVStats(
                bytes_sent_total=c.bytes_sent,
                bytes_received_total=c.bytes_received,
                blocks_sent_total=c.blocks_sent,
                blocks_received_total=c.blocks_received,
                kv_tokens_loaded_total=c.kv_tokens_loaded,
                transfer_seconds_total=c.transfer_seconds,
                loads_failed_total=c.loads_failed,
                leases_expired_total=c.leases_expired,
                num_held_requests=len(self._holds),
                num_held_blocks=sum(len(h.block_ids) for h in self._holds.values()),
            )
            record = c.requests.get(request_id) if request_id else None
        if record is not None:
            msg.request_found = True
            msg.request.CopyFrom(record)
        if self.layout is not None:
            msg.layout.CopyFrom(self.layout.to_proto())
        return msg

    # -- decode side: pulling ----------------------------------------------------

    def _channel(self, handle: KVHandleParams) -> grpc.Channel:
        host, _, port = handle.kv_address.rpartition(":")
        address = f"{host}:{int(port) + self._tp_rank}"
        channel = self._channels.get(address)
        if channel is None:
            channel = tls_channel(address, self._tls, options=list(_CLIENT_OPTIONS))
            self._channels[address] = channel
        return channel

    def _stub(self, handle: KVHandleParams) -> kv_transfer_pb2_grpc.KVTransferStub:
        return kv_transfer_pb2_grpc.KVTransferStub(self._channel(handle))

    def _load(self, spec: LoadSpec) -> None:
        assert self.layout is not None
        started = time.perf_counter()
        num_bytes = 0
        record = kv_transfer_pb2.KVRequestStats(num_kv_tokens_loaded=spec.num_tokens)
        try:
            pull: grpc.UnaryStreamMultiCallable[kv_transfer_pb2.PullBlocksRequest, bytes]
            pull = self._channel(spec.handle).unary_stream(
                wire.PULL_METHOD,
                request_serializer=kv_transfer_pb2.PullBlocksRequest.SerializeToString,
                response_deserializer=None,  # raw bytes
            )
            stream = pull(
                kv_transfer_pb2.PullBlocksRequest(
                    remote_request_id=spec.handle.remote_request_id,
                    block_ids=list(spec.remote_block_ids),
                    expected_layout=self.layout.to_proto(),
                    max_chunk_bytes=self._max_chunk_bytes,
                ),
                timeout=self._pull_timeout_s,
            )
            num_bytes = wire.write_chunks(
                [cache for _, cache in self._layers],
                self._block_dim,
                spec.local_block_ids,
                self._max_chunk_bytes,
                stream,
            )
        except Exception as exc:
            message = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            logger.error("KV load of %s from %s failed: %s", spec.request_id, spec.handle.kv_address, message)
            record.failed = True
            record.error = str(message)[:500]
            with self._lock:
                self._failed_recving.add(spec.request_id)
                self._failed_block_ids.update(spec.local_block_ids)
                self._counters.loads_failed += 1
        finally:
            seconds = time.perf_counter() - started
            record.num_bytes = num_bytes
            record.seconds = seconds
            record.num_blocks_loaded = len(spec.local_block_ids)
            with self._lock:
                c = self._counters
                c.bytes_received += num_bytes
                c.transfer_seconds += seconds
                if not record.failed:
                    c.blocks_received += len(spec.local_block_ids)
                    c.kv_tokens_loaded += spec.num_tokens
                c.requests[external_request_id(spec.request_id)] = record
                while len(c.requests) > _MAX_REQUEST_RECORDS:
                    c.requests.popitem(last=False)
                self._done_recving.add(spec.request_id)
                self._num_loads_in_flight -= 1
                self._load_finished.notify_all()
        self._release_remote(spec.handle)

    def _release_remote(self, handle: KVHandleParams) -> None:
        try:
            self._stub(handle).Release(
                kv_transfer_pb2.ReleaseBlocksRequest(remote_request_id=handle.remote_request_id), timeout=5.0
            )
        except grpc.RpcError as exc:
            # The lease on the prefill side frees the blocks anyway.
            logger.warning("releasing %s on %s failed: %s", handle.remote_request_id, handle.kv_address, exc)


class _KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """gRPC face of :class:`WorkerSide`; runs on the KV server's threads."""

    def __init__(self, side: WorkerSide) -> None:
        self._side = side

    def Describe(self, request: kv_transfer_pb2.DescribeRequest, context: grpc.ServicerContext) -> common_pb2.KVLayout:
        assert self._side.layout is not None
        return self._side.layout.to_proto()

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
        side = self._side
        assert side.layout is not None
        try:
            side.layout.check_compatible(KVLayout.from_proto(request.expected_layout))
        except KVLayoutMismatchError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        hold = side.wait_for_hold(request.remote_request_id)
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
        for chunk in side.read_chunks(wanted, max_chunk):
            total += len(chunk)
            yield chunk
        side.count_sent(total, len(wanted))

    def Release(
        self, request: kv_transfer_pb2.ReleaseBlocksRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.ReleaseBlocksResponse:
        return kv_transfer_pb2.ReleaseBlocksResponse(found=self._side.release(request.remote_request_id))

    def GetStats(
        self, request: kv_transfer_pb2.KVStatsRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.KVStats:
        return self._side.stats(request.request_id)
