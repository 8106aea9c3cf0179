"""A running prefill's KV through shared memory: the prefetch's data path between two workers of one host.

``StreamBlocksShm`` is ``StreamBlockBytes`` (the prefetch's gRPC stream) with
the bytes moved by shared memory instead of messages: the same checks
(layout, capability, adapter, prompt length, the block range), then a segment
of the shared directory (:mod:`shm`), into which the prefill side copies each
piece of the prompt's blocks as soon as its layer is saved, in the stream's
order (:func:`wire.ready_pieces`), telling the caller which pieces are written
(:func:`wire.stream_header`, the gRPC stream's message header without its
bytes). The segment is laid out as the decode side's staging
(:func:`wire.staging_views`): the decode side keeps it as the staging and
copies from it into its paged cache at the load, so no socket carries the
bytes, nothing serializes them, and the prompt's KV is copied twice (out of the
prefill's cache, into the decode's) as by a pull through shared memory.

Once every piece is written the stream stays open, silent, until the caller
ends it (its load copied the blocks, or the prefetch was dropped: abort, a
decode that loads nothing, its keep time) or its deadline passes, and the
segment is the caller's until then, never longer than the prefill's KV lease
(sent as ``keep_s``; the caller uses the segment only within it). A caller
that dies ends its stream with its channel. The segment is owned under a name
of the stream's own, so the prompt's hold ending (the decode's Release, the
lease, a prefill that ends) does not free it while the decode still reads it.

The caller (:mod:`prefetch`) falls back to the gRPC stream on any failure,
counted by reason like the pull's (``tandem_kv_shm_fallbacks_total``):
``peer_refused`` (refused or unreachable before the segment was named: every
segment in use, the directory's token, the prompt's checks), ``wrong_size``,
``segment_missing``, ``permission``, ``failed`` (the stream broke off, or said
pieces out of order). A prefill that ends without keeping its KV (``ABORTED``)
or a deadline that passed falls back to nothing: the gRPC stream would say the
same."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import grpc
import torch

from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import shm, wire
from tandem.worker.kv_connector.shm_transport import SEGMENT_WAIT_S, SharedMemory

#: The decode side stops using a segment this long before the prefill side may take it back.
USE_MARGIN_S: Final = 1.0
#: Answers a stream of the prompt's own would get as well: no fallback to the gRPC stream.
_NO_FALLBACK: Final = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)


def serve(
    pool: shm.SegmentPool,
    caches: Sequence[torch.Tensor],
    block_dim: int,
    block_bytes: int,
    request: kv_transfer_pb2.StreamBlocksRequest,
    progress: Iterator[list[wire.Piece]],
    block_ids: Callable[[], Sequence[int]],
    check_gone: Callable[[], None],
    context: grpc.ServicerContext,
    count_sent: Callable[[int], None],
) -> Iterator[kv_transfer_pb2.ShmPiecesReady]:
    """Prefill side of ``StreamBlocksShm`` once its checks passed: a segment for the stream, each piece of
    ``progress`` (the stream's pieces as their layers are saved) copied from the cache blocks ``block_ids()``
    names (known as the prefill goes) into it and said, then the segment kept until the call ends.
    ``check_gone`` aborts the call when the prompt ended meanwhile (its blocks may hold another's KV);
    ``count_sent`` is told the bytes once every piece is written.
    Raises :class:`shm.ShmError` (peer_refused) when no segment is free after :data:`SEGMENT_WAIT_S`."""
    num_blocks = request.num_blocks
    num_bytes = len(caches) * num_blocks * block_bytes
    # An owner of the stream's own: the hold ending (Release, the lease) must not free what the decode reads.
    owner = f"{request.request_id}#prefetch-{secrets.token_hex(4)}"
    segment = pool.acquire(num_bytes, owner, wait_s=SEGMENT_WAIT_S)
    if segment is None:
        raise shm.ShmError("peer_refused", "every shared-memory segment of this engine is in use (or none fits)")
    acquired_s = time.monotonic()
    view = memoryview(segment.map)
    views = wire.staging_views(view, caches[0], len(caches), block_dim, num_blocks)
    try:
        yield kv_transfer_pb2.ShmPiecesReady(segment=segment.name, num_bytes=num_bytes, keep_s=pool.max_owned_s)
        first = request.first_block_index
        num_written = 0
        for pieces in progress:
            ids = block_ids()[first : first + num_blocks]
            for p in pieces:
                src = ids[p.first : p.first + p.num_blocks]
                dst = range(p.first, p.first + p.num_blocks)
                wire.copy_blocks([caches[p.layer_index]], src, [views[p.layer_index]], dst, block_dim)
            check_gone()  # copied, then looked at: a prompt that ended meanwhile may have had its blocks rewritten
            num_written += sum(p.num_blocks for p in pieces)
            yield kv_transfer_pb2.ShmPiecesReady(pieces=wire.stream_header(pieces))
        if num_written < len(caches) * num_blocks:
            return  # the caller gave up
        count_sent(num_bytes)
        # Every piece written: the segment is the caller's staging until it ends the call (or the lease).
        ended = threading.Event()
        if context.add_callback(ended.set):
            ended.wait(max(0.0, pool.max_owned_s - (time.monotonic() - acquired_s)))
    finally:
        views.clear()
        try:
            view.release()
        except BufferError:  # an exception's traceback still holds a view: it goes with it
            pass
        pool.release_owner(owner)


@dataclass
class Staged:
    """A prefetch staged in a peer's segment: ``layers`` view it (read-only), usable until ``usable_until_s``
    (monotonic), after which the peer may give the segment to another stream."""

    layers: list[torch.Tensor]
    view: memoryview
    num_bytes: int
    usable_until_s: float

    def close(self) -> None:
        self.layers = []
        try:
            self.view.release()
        except BufferError:  # a tensor of it still lives somewhere: the mapping goes with it
            pass


def stream(
    memory: SharedMemory,
    channel: grpc.Channel,
    request: kv_transfer_pb2.StreamBlocksRequest,
    caches: Sequence[torch.Tensor],
    block_dim: int,
    timeout_s: float,
    on_call: Callable[[grpc.Call], None],
) -> Staged:
    """Decode side: stream ``request``'s blocks into a segment of the peer at ``channel`` and return them
    staged there once every piece is said written; the call stays open (``on_call`` is given it: cancel it
    to give the segment back). Raises :class:`shm.ShmError` (fall back to the gRPC stream) or
    ``grpc.RpcError`` (the prefill ended, or no time left: no fallback)."""
    started_s = time.monotonic()
    call = kv_transfer_pb2_grpc.KVTransferStub(channel).StreamBlocksShm(
        kv_transfer_pb2.ShmStreamRequest(stream=request, shm_dir_token=memory.dir_token), timeout=timeout_s
    )
    on_call(call)
    try:
        first = next(call)
    except grpc.RpcError as exc:
        if exc.code() in _NO_FALLBACK:
            raise
        raise shm.ShmError("peer_refused", f"{exc.code().name}: {exc.details()}") from exc
    except StopIteration as exc:
        raise shm.ShmError("failed", "the shared-memory stream ended at once") from exc
    block_bytes = wire.block_bytes_of(caches[0], block_dim)
    num_bytes = len(caches) * request.num_blocks * block_bytes
    if first.num_bytes != num_bytes:
        raise shm.ShmError("wrong_size", f"the peer's segment holds {first.num_bytes} bytes, the stream {num_bytes}")
    view = memory.maps.view(first.segment, num_bytes)
    try:
        layers = wire.staging_views(view, caches[0], len(caches), block_dim, request.num_blocks)
        order = wire.StreamOrder(len(caches), request.num_blocks)
        while not order.complete:
            try:
                message = next(call, None)
            except grpc.RpcError as exc:
                if exc.code() in _NO_FALLBACK:
                    raise
                raise shm.ShmError("failed", f"{exc.code().name}: {exc.details()}") from exc
            if message is None:
                raise shm.ShmError("failed", f"the stream ended with {order.num_received} blocks written")
            try:
                for piece in wire.parse_stream_header(message.pieces, exact=True)[0]:
                    order.take(piece)
            except ValueError as exc:
                raise shm.ShmError("failed", str(exc)) from exc
        usable_until_s = started_s + min(timeout_s, first.keep_s) - USE_MARGIN_S
        return Staged(layers, view, num_bytes, usable_until_s)
    except BaseException:
        layers = []
        try:
            view.release()
        except BufferError:
            pass
        raise
