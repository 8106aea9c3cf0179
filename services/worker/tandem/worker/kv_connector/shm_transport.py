"""The KV pull through shared memory, chosen per pair of workers, with gRPC as the fallback.

gRPC stays the control plane: ``DataPaths`` says what a prefill engine offers,
``PullBlocksShm`` runs the same checks as ``PullBlockBytes`` (layout,
capability, adapter, held blocks: the KV server's one ``held_blocks``) and
then, instead of sending the bytes, copies them out of the cache into a
segment of the shared directory (:mod:`shm`) in the wire's chunk order and
bytes (:func:`wire.chunk_plan`, :meth:`wire.BlockReader.read_into`), telling
the caller after each chunk. The decode side copies each chunk as soon as it
is said written, straight from the mapping into its paged cache, through the
same :class:`wire.BlockWriter` as a gRPC pull (same size checks), so the two
copies overlap. No socket carries the bytes and nothing serializes them.

A decode engine asks each peer's ``DataPaths`` once a minute
(:data:`PEER_TTL_S`) and pulls by shared memory when the peer offers it on the
same host and directory (:class:`ShmPuller`); otherwise it pulls over gRPC
without counting anything. A shared-memory pull that fails for any reason
falls back to the gRPC pull within the same pull deadline, counted by reason
(``tandem_kv_shm_fallbacks_total{reason}``): ``segment_missing``,
``wrong_size``, ``permission``, ``peer_refused`` (refused, unreachable, or
every segment in use), ``failed`` (the stream broke off mid-pull).

A segment is used by one pull of one request: it returns to the pool when the
stream ends before every chunk was said (the caller gave up or died), else
when the request's hold ends (Release after the load, or the lease), the same
moments the prefill engine's blocks are freed."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Final

import grpc

from tandem.common import failpoints
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import shm, wire

logger = logging.getLogger(__name__)

#: How long a decode engine trusts a peer's ``DataPaths`` answer (and a failed ask).
PEER_TTL_S: Final = 60.0
#: How long a pull that finds every segment in use waits for one to be freed before it is refused (and falls
#: back to gRPC). A segment is freed by its pull's Release, a few ms after its last chunk on this host (four
#: ~1k-token pulls at once took ~40 ms through shared memory, 2026-12-07), while the gRPC pull it would fall
#: back to costs about three times the CPU per byte of a loopback stream (``make bench-kv``'s concurrent round):
#: a burst of more pulls than segments keeps to shared memory instead of loading the cores with gRPC's copies.
#: A holder that never releases costs a pull this much, once (its segment is reclaimed after the lease).
SEGMENT_WAIT_S: Final = 0.1


class SharedMemory:
    """One engine rank's end of the shared-memory path (both roles): its identity, its pool (prefill), its
    mappings (decode) and the sweeper. ``max_age_s`` is the KV lease."""

    def __init__(self, directory: str, *, max_segments: int, max_age_s: float, node_name: str = "") -> None:
        self.directory = directory
        self.host_id = shm.host_id(node_name)
        self.dir_token = shm.dir_token(directory)
        self.pool = shm.SegmentPool(directory, max_segments, max_age_s)
        self.maps = shm.SegmentMaps(directory)
        self._sweeper = shm.Sweeper(directory, max_age_s, self.pool, self.maps)
        self._sweeper.start()

    def data_paths(self) -> kv_transfer_pb2.DataPathsReply:
        return kv_transfer_pb2.DataPathsReply(
            data_paths=["grpc", "shm"], shm_host_id=self.host_id, shm_dir_token=self.dir_token
        )

    def shares(self, reply: kv_transfer_pb2.DataPathsReply) -> bool:
        """Whether a peer that answered ``reply`` can hand this one KV through shared memory."""
        return "shm" in reply.data_paths and (reply.shm_host_id, reply.shm_dir_token) == (self.host_id, self.dir_token)

    def close(self) -> None:
        self._sweeper.stop()
        self.pool.close()
        self.maps.close()


def data_paths(memory: SharedMemory | None) -> kv_transfer_pb2.DataPathsReply:
    """``DataPaths``: gRPC, and shared memory where ``memory`` is on."""
    return kv_transfer_pb2.DataPathsReply(data_paths=["grpc"]) if memory is None else memory.data_paths()


def serve(
    memory: SharedMemory | None,
    request: kv_transfer_pb2.ShmPullRequest,
    context: grpc.ServicerContext,
    held_blocks: Callable[[kv_transfer_pb2.PullBlocksRequest, grpc.ServicerContext], list[int]],
    reader: wire.BlockReader,
    count_sent: Callable[[int, int], None],
) -> Iterator[kv_transfer_pb2.ShmChunksReady]:
    """``PullBlocksShm``: refused unless the caller opens this engine's directory; then the KV server's
    ``held_blocks`` checks (those of every pull), and the blocks written into a segment (:func:`serve_pull`)."""
    if memory is None or request.shm_dir_token != memory.dir_token:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no shared memory with this engine")
    assert memory is not None
    wanted = held_blocks(request.pull, context)
    failpoints.hit("kv_shm.serve")
    try:
        max_chunk = request.pull.max_chunk_bytes or 4 * 1024 * 1024
        yield from serve_pull(memory.pool, reader, wanted, max_chunk, request.pull.request_id)
    except shm.ShmError as exc:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    count_sent(len(wanted) * reader.block_bytes * reader.num_layers, len(wanted))


def serve_pull(
    memory: shm.SegmentPool,
    reader: wire.BlockReader,
    block_ids: list[int],
    max_chunk_bytes: int,
    request_id: str,
) -> Iterator[kv_transfer_pb2.ShmChunksReady]:
    """Prefill side of ``PullBlocksShm`` once its checks passed: a segment for ``request_id``, the blocks
    written into it chunk by chunk, each said. Raises :class:`shm.ShmError` (peer_refused) when every
    segment is still in use after :data:`SEGMENT_WAIT_S` or none can be made."""
    plan = reader.plan(len(block_ids), max_chunk_bytes)
    num_bytes = sum(c.num_blocks for c in plan) * reader.block_bytes
    segment = memory.acquire(num_bytes, request_id, wait_s=SEGMENT_WAIT_S)
    if segment is None:
        raise shm.ShmError("peer_refused", "every shared-memory segment of this engine is in use (or none fits)")
    complete = False
    view = memoryview(segment.map)
    try:
        yield kv_transfer_pb2.ShmChunksReady(segment=segment.name, num_bytes=num_bytes)
        offset = 0
        for index, chunk in enumerate(plan):
            offset += reader.read_into(block_ids, chunk, view[offset:])
            yield kv_transfer_pb2.ShmChunksReady(num_chunks_ready=index + 1)
        complete = True
    finally:
        try:
            view.release()
        except BufferError:  # an exception's traceback still holds a view: it goes with it
            pass
        if not complete:  # the caller gave up or died: nobody reads it any more
            memory.release(segment)


class ShmPuller:
    """Decode side: picks the path per peer and pulls by shared memory, counting its fallbacks."""

    def __init__(self, memory: SharedMemory) -> None:
        self.memory = memory
        self._peers: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()
        self.num_loads = 0
        #: Prefetches streamed through shared memory (:mod:`shm_stream`), every piece written.
        self.num_prefetches = 0
        #: Pulls and prefetches that fell back to gRPC, by reason.
        self.fallbacks: Counter[str] = Counter()

    def shares_with(self, channel: grpc.Channel, address: str) -> bool:
        """Whether the peer at ``address`` hands KV to this engine through shared memory (asked once per
        :data:`PEER_TTL_S`)."""
        now = time.monotonic()
        with self._lock:
            known = self._peers.get(address)
        if known is not None and known[0] > now:
            return known[1]
        try:
            reply = kv_transfer_pb2_grpc.KVTransferStub(channel).DataPaths(
                kv_transfer_pb2.DataPathsRequest(), timeout=5.0
            )
            shares = self.memory.shares(reply)
        except grpc.RpcError as exc:  # an older peer (UNIMPLEMENTED), or unreachable: gRPC, as ever
            logger.info("KV data paths of %s unknown (%s): pulling over gRPC", address, exc.code())
            shares = False
        with self._lock:
            self._peers[address] = (now + PEER_TTL_S, shares)
        return shares

    def pull(
        self,
        channel: grpc.Channel,
        address: str,
        request: kv_transfer_pb2.PullBlocksRequest,
        writer: wire.BlockWriter,
        local_block_ids: tuple[int, ...],
        timeout_s: float,
    ) -> int | None:
        """Pull ``request``'s blocks into ``local_block_ids`` through shared memory when the peer at
        ``address`` shares it; the bytes written, or None: pull over gRPC (a fallback is counted)."""
        if not self.shares_with(channel, address):
            return None
        try:
            num_bytes = self._pull(channel, request, writer, local_block_ids, timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise  # no time left for a fallback: the load fails as a hung gRPC pull would
            self.fall_back(address, request.request_id, shm.ShmError("failed", f"{exc.code().name}: {exc.details()}"))
            return None
        except shm.ShmError as exc:
            self.fall_back(address, request.request_id, exc)
            return None
        except Exception as exc:  # any other failure (a mapping refused, ...) falls back too
            self.fall_back(address, request.request_id, shm.ShmError("failed", f"{type(exc).__name__}: {exc}"))
            return None
        with self._lock:
            self.num_loads += 1
        return num_bytes

    def fall_back(self, address: str, request_id: str, exc: shm.ShmError, what: str = "pull") -> None:
        """Count ``request_id``'s ``what`` (pull, prefetch) through shared memory falling back to gRPC."""
        with self._lock:
            self.fallbacks[exc.reason] += 1
            if exc.reason != "failed":  # ask again before the next pull: the peer may have changed
                self._peers.pop(address, None)
        logger.warning("KV %s of %s by shared memory fell back to gRPC (%s): %s", what, request_id, exc.reason, exc)

    def count_prefetch(self) -> None:
        with self._lock:
            self.num_prefetches += 1

    def _pull(
        self,
        channel: grpc.Channel,
        request: kv_transfer_pb2.PullBlocksRequest,
        writer: wire.BlockWriter,
        local_block_ids: tuple[int, ...],
        timeout_s: float,
    ) -> int:
        plan = wire.chunk_plan(writer.num_layers, len(local_block_ids), writer.block_bytes, request.max_chunk_bytes)
        sizes = [c.num_blocks * writer.block_bytes for c in plan]
        call = kv_transfer_pb2_grpc.KVTransferStub(channel).PullBlocksShm(
            kv_transfer_pb2.ShmPullRequest(pull=request, shm_dir_token=self.memory.dir_token), timeout=timeout_s
        )
        try:
            try:
                first = next(call)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise  # no time left for a fallback: the load fails as a hung gRPC pull would
                raise shm.ShmError("peer_refused", f"{exc.code().name}: {exc.details()}") from exc
            except StopIteration as exc:
                raise shm.ShmError("failed", "the shared-memory stream ended at once") from exc
            if first.num_bytes != sum(sizes):
                raise shm.ShmError("wrong_size", f"the peer wrote {first.num_bytes} bytes, the pull is {sum(sizes)}")
            view = self.memory.maps.view(first.segment, first.num_bytes)
            try:
                num_bytes = writer.write_chunks(
                    local_block_ids, request.max_chunk_bytes, _ready_chunks(call, view, sizes)
                )
                for _ in call:  # the stream's end: the peer's status, and its count of what it sent
                    pass
                return num_bytes
            except ValueError as exc:  # too few chunks said (a broken stream raises RpcError: see pull)
                raise shm.ShmError("failed", f"the shared-memory pull broke off: {exc}") from exc
            finally:
                view.release()
        finally:
            call.cancel()


def _ready_chunks(
    call: Iterator[kv_transfer_pb2.ShmChunksReady], view: memoryview, sizes: list[int]
) -> Iterator[memoryview]:
    """Each chunk of ``view`` once the stream said it is written (in plan order)."""
    ready = 0
    offset = 0
    for index, size in enumerate(sizes):
        while ready <= index:
            message = next(call, None)
            if message is None:
                raise ValueError(f"the stream ended with {ready} of {len(sizes)} chunks written")
            ready = message.num_chunks_ready
        yield view[offset : offset + size]
        offset += size
