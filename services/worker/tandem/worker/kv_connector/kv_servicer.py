"""The gRPC face of :class:`~tandem.worker.kv_connector.kv_server.KVServer`: ``tandem.v1.KVTransfer``'s
methods, run on the KV server's threads. Each checks what the caller asks for (layout, capability,
adapter, held blocks) and hands the reading to the server: ``PullBlockBytes`` and ``StreamBlockBytes``
answer raw bytes (:mod:`wire`, hence the generic handlers without a response serializer),
``PullBlocksShm`` writes the same bytes into shared memory (:mod:`shm_transport`, through the same
checks), as ``StreamBlocksShm`` does a running prefill's (:mod:`shm_stream`), ``Release`` ends a hold,
``Describe`` and ``GetStats`` answer people and tools."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc

from tandem.common import failpoints, kv_capability
from tandem.common.errors import KVLayoutMismatchError
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import shm, shm_stream, shm_transport, wire
from tandem.worker.kv_connector.layout import KVLayout

if TYPE_CHECKING:
    from tandem.worker.kv_connector.kv_server import Hold, KVServer


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """gRPC face of :class:`KVServer`; runs on the KV server's threads."""

    def __init__(self, server: KVServer, stats: Callable[[], kv_transfer_pb2.KVStats]) -> None:
        self._kv = server
        self._stats = stats

    def Describe(self, request: kv_transfer_pb2.DescribeRequest, context: grpc.ServicerContext) -> common_pb2.KVLayout:
        assert self._kv.layout is not None
        return self._kv.layout.to_proto()

    def raw_handlers(self) -> grpc.GenericRpcHandler:
        """``PullBlockBytes`` and ``StreamBlockBytes``: raw bytes out (see :mod:`wire`), so no
        response serializer."""
        _, service, pull = wire.PULL_METHOD.split("/")
        stream = wire.STREAM_METHOD.rsplit("/", 1)[1]
        return grpc.method_handlers_generic_handler(
            service,
            {
                pull: grpc.unary_stream_rpc_method_handler(
                    self.pull_block_bytes, request_deserializer=kv_transfer_pb2.PullBlocksRequest.FromString
                ),
                stream: grpc.unary_stream_rpc_method_handler(
                    self.stream_block_bytes, request_deserializer=kv_transfer_pb2.StreamBlocksRequest.FromString
                ),
            },
        )

    def _check_layout(self, expected: common_pb2.KVLayout, context: grpc.ServicerContext) -> None:
        assert self._kv.layout is not None
        try:
            self._kv.layout.check_compatible(KVLayout.from_proto(expected))
        except KVLayoutMismatchError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    def _held_blocks(self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.ServicerContext) -> list[int]:
        """The blocks a pull asks for, once its layout, capability, adapter and blocks are checked (either path)."""
        kv = self._kv
        self._check_layout(request.expected_layout, context)
        hold = kv.wait_for_hold(request.request_id)
        if hold is None or not kv_capability.matches(hold.capability, request.capability):
            # The same answer as for an id nobody holds: a wrong capability learns nothing.
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no KV held for {request.request_id} (released, expired or never prefilled)",
            )
        assert hold is not None
        # Computed with other weights (a handle that names the wrong adapter): the decode side applies its
        # load-failure policy (recompute) rather than answer with neither adapter.
        self._check_adapter(hold, request.request_id, request.adapter, context)
        wanted = list(request.block_ids)
        if not set(wanted) <= set(hold.block_ids):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks {sorted(set(wanted) - set(hold.block_ids))} are not held for this request",
            )
        failpoints.hit("kv_server.before_pull")
        return wanted

    def pull_block_bytes(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        kv = self._kv
        wanted = self._held_blocks(request, context)
        max_chunk = request.max_chunk_bytes or 4 * 1024 * 1024
        total = 0
        for chunk in kv.read_chunks(wanted, max_chunk):
            total += len(chunk)
            yield chunk
        kv.count_sent(total, len(wanted))

    def stream_block_bytes(
        self, request: kv_transfer_pb2.StreamBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        kv = self._kv
        hold = self._streamed_prompt(request, context)
        if hold is None:
            return
        reader = kv.reader()
        max_chunk_blocks = max(1, (request.max_chunk_bytes or 4 * 1024 * 1024) // max(1, reader.block_bytes))
        first, num_blocks = request.first_block_index, request.num_blocks
        total = 0
        for pieces in self._progress(hold, request, context, max_chunk_blocks):
            ids = hold.block_ids[first : first + num_blocks]
            data = reader.read(ids, wire.Chunk(tuple(pieces)), prefix=wire.stream_header(pieces))
            # Read, then looked at: a prompt that ended meanwhile may have had its blocks rewritten.
            self._abort_gone(hold, request.request_id, context)
            total += sum(p.num_blocks for p in pieces) * reader.block_bytes
            yield data
        if total == num_blocks * reader.num_layers * reader.block_bytes:  # not a caller that gave up
            kv.count_sent(total, num_blocks, streamed=True)

    def _streamed_prompt(
        self, request: kv_transfer_pb2.StreamBlocksRequest, context: grpc.ServicerContext
    ) -> Hold | None:
        """The prompt a stream asks for, once it is scheduled and its layout, capability, adapter, length and
        block range are checked (either path); None when the caller gave up first."""
        kv = self._kv
        assert kv.layout is not None
        self._check_layout(request.expected_layout, context)
        hold = kv.find_prompt(request.request_id, context.is_active)
        if hold is None:
            return None
        self._abort_gone(hold, request.request_id, context)
        if not kv_capability.matches(hold.capability, request.capability):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no prompt {request.request_id} is being prefilled or held")
        # The same check as a pull's: a prefetch for another adapter stages nothing (its decode pulls, and
        # that pull is refused too).
        self._check_adapter(hold, request.request_id, request.adapter, context)
        if hold.num_prompt_tokens and hold.num_prompt_tokens != request.num_prompt_tokens:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{request.request_id} is a prompt of {hold.num_prompt_tokens} tokens, not {request.num_prompt_tokens}",
            )
        block_size = kv.layout.block_size_tokens
        first, num_blocks = request.first_block_index, request.num_blocks
        num_prompt_tokens = request.num_prompt_tokens
        if num_blocks == 0 or (first + num_blocks - 1) * block_size >= num_prompt_tokens:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks {first}..{first + num_blocks - 1} are not all in a prompt of {num_prompt_tokens} tokens",
            )
        failpoints.hit("kv_server.before_stream")
        return hold

    def _progress(
        self,
        hold: Hold,
        request: kv_transfer_pb2.StreamBlocksRequest,
        context: grpc.ServicerContext,
        max_chunk_blocks: int,
    ) -> Iterator[list[wire.Piece]]:
        """The stream's pieces (:func:`wire.ready_pieces`) as their layers are saved, each as soon as it is;
        ABORTED when the prompt ends without a hold; ends early when the caller gives up."""
        num_blocks = request.num_blocks
        sent = [0] * self._kv.reader().num_layers
        while any(n < num_blocks for n in sent):
            ready = self._kv.wait_progress(hold, sent, (request.first_block_index, num_blocks), context.is_active)
            if ready is None:
                self._abort_gone(hold, request.request_id, context)
                return
            yield wire.ready_pieces(sent, ready, max_chunk_blocks)

    @staticmethod
    def _check_adapter(hold: Hold, request_id: str, adapter: str, context: grpc.ServicerContext) -> None:
        """FAILED_PRECONDITION unless ``hold``'s KV is (being) computed with ``adapter``."""
        if hold.adapter != adapter:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the KV of {request_id} was computed with adapter {hold.adapter or '(base model)'!r}, "
                f"not {adapter or '(base model)'!r}",
            )

    @staticmethod
    def _abort_gone(hold: Hold, request_id: str, context: grpc.ServicerContext) -> None:
        if hold.gone:
            context.abort(
                grpc.StatusCode.ABORTED,
                f"the prefill of {request_id} ended without keeping its KV (stopped, aborted or preempted)",
            )

    def DataPaths(
        self, request: kv_transfer_pb2.DataPathsRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.DataPathsReply:
        return shm_transport.data_paths(self._kv.shm)

    def PullBlocksShm(
        self, request: kv_transfer_pb2.ShmPullRequest, context: grpc.ServicerContext
    ) -> Iterator[kv_transfer_pb2.ShmChunksReady]:
        kv = self._kv
        return shm_transport.serve(kv.shm, request, context, self._held_blocks, kv.reader(), kv.count_sent)

    def StreamBlocksShm(
        self, request: kv_transfer_pb2.ShmStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[kv_transfer_pb2.ShmPiecesReady]:
        kv = self._kv
        memory = kv.shm
        if memory is None or request.shm_dir_token != memory.dir_token:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no shared memory with this engine")
        assert memory is not None
        stream = request.stream
        hold = self._streamed_prompt(stream, context)
        if hold is None:
            return
        reader = kv.reader()
        # Every piece ready is written at once: no message carries the bytes, so no chunk size bounds them.
        progress = self._progress(hold, stream, context, reader.num_layers * stream.num_blocks)
        try:
            yield from shm_stream.serve(
                memory.pool,
                kv.caches,
                kv.block_dim,
                reader.block_bytes,
                stream,
                progress,
                lambda: hold.block_ids,
                lambda: self._abort_gone(hold, stream.request_id, context),
                context,
                lambda num_bytes: kv.count_sent(num_bytes, stream.num_blocks, streamed=True),
            )
        except shm.ShmError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    def Release(
        self, request: kv_transfer_pb2.ReleaseBlocksRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.ReleaseBlocksResponse:
        found = self._kv.release_hold(request.request_id, capability=request.capability)
        return kv_transfer_pb2.ReleaseBlocksResponse(found=found)

    def GetStats(
        self, request: kv_transfer_pb2.KVStatsRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.KVStats:
        return self._stats()
