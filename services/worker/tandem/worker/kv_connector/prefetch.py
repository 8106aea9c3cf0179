"""Decode side's prefetches: a prompt's KV streamed from the prefill engine while it still computes it.

A prefetch is a pull started before the decode request exists (the gateway
asks for it when the request is placed, ``PrefetchKV``): it streams the
prompt's blocks from the prefill engine while that engine still computes them,
each piece as its layer is saved, into a staging of the blocks by position.
When the decode request's load comes (:class:`~tandem.worker.kv_connector.puller.KVPuller`),
it waits for the prefetch to finish (usually it has) and copies the blocks it
needs from staging into the paged cache: a local copy on the second token's
critical path instead of the network. A prefetch that failed, or does not
cover the blocks the load needs, is dropped and the load pulls as it would
without one; staging is bounded (``prefetch_max_bytes``) and freed when the
load has copied it, when the request is aborted here, when its decode needs no
load (its prompt was in this engine's prefix cache), or ``prefetch_keep_s``
after it was started.

The staging is where the bytes crossed: from a prefill engine that offers
shared memory on this host and directory (the pull's per-peer choice,
:class:`~tandem.worker.kv_connector.shm_transport.ShmPuller`), the prefill side
writes the pieces into a segment laid out as the staging and the staging *is*
that segment (:mod:`shm_stream`), given back by ending the stream's call when
the staging is freed; otherwise, or when that fails (counted by reason), the
pieces come over ``StreamBlockBytes`` into tensors of this process.

A prefetch names the LoRA adapter its decode will run with (``PrefetchKV``'s
``adapter``), and streams with it: the prefill engine's KV server refuses a
prompt it computes with another adapter, as it refuses such a pull. A load
whose handle names another adapter than its prefetch does not use what was
staged (counted wasted) and pulls, so staged KV of adapter A never serves a
decode of adapter B or of the base model.

The prefetch and the load name the prompt's KV by the same id, the gateway's
request id: ``PrefetchKV`` carries it, and the load's handle carries it from
the ``Decode`` (:mod:`params`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import torch
from google.protobuf.message import Message

from tandem.common import kv_capability
from tandem.v1 import kv_transfer_pb2
from tandem.worker.kv_connector import shm, shm_stream, wire
from tandem.worker.kv_connector.cpus import move_this_thread
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.metadata import LoadSpec
from tandem.worker.kv_connector.params import KVHandleParams, PrefetchOrder
from tandem.worker.kv_connector.shm_transport import ShmPuller

if TYPE_CHECKING:
    from tandem.worker.kv_connector.puller import PullCounters

logger = logging.getLogger(__name__)

#: Prefetches streaming at once (each holds a thread while its prefill runs); more are refused.
MAX_PREFETCHES_IN_FLIGHT = 8
#: Requests whose load pulled without a prefetch, or that were aborted here, remembered so that a
#: PrefetchKV arriving after its Decode's load or after its Abort (the gateway sends PrefetchKV in the
#: background: a request refused by its prefill worker is aborted here, and the Abort can overtake it)
#: is refused instead of staging KV nobody will use until prefetch_keep_s.
_NUM_LOADED_REMEMBERED = 1024


@dataclass
class Prefetch:
    """One prompt's blocks [first_block_index, first_block_index + num_blocks), streamed as ``order`` says
    into ``staging`` (one tensor per layer, the cache's shape with ``num_blocks`` blocks). A load uses the
    staged blocks only if its handle names the order's prompt: the same engine, request, capability, adapter
    ("" for the base model) and number of tokens."""

    order: PrefetchOrder
    first_block_index: int
    num_blocks: int
    staging: list[torch.Tensor] | None
    num_staged_bytes: int
    expires_s: float
    done: threading.Event = field(default_factory=threading.Event)
    #: The stream's call (gRPC or shared memory): cancelled when dropped, and, through shared memory, when
    #: the staging is freed (that gives the peer's segment back).
    call: grpc.Call | None = None
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0
    #: Dropped (aborted, expired, taken by its load): whatever the stream's thread staged is freed at once.
    dropped: bool = False
    #: Staged in a peer's shared-memory segment (None: in this process's memory, or nothing yet).
    shm: shm_stream.Staged | None = None

    def covers(self, first_block_index: int, num_blocks: int) -> bool:
        return (
            self.first_block_index <= first_block_index
            and first_block_index + num_blocks <= self.first_block_index + self.num_blocks
        )


def _same_prompt(prefetch: Prefetch, handle: KVHandleParams) -> bool:
    """Whether ``prefetch`` streamed the KV ``handle`` names: the same prefill engine, request and
    capability."""
    order = prefetch.order
    return (
        order.kv_address == handle.kv_address
        and order.request_id == handle.request_id
        and kv_capability.matches(order.capability, handle.capability)
    )


#: A server stream of raw bytes from the KV server at an address (see ``KVPuller._raw_stream``).
RawStream = Callable[[str, str, Message], "grpc._CallIterator[bytes]"]


class Prefetcher:
    """One engine rank's prefetches, by request id, and their staging."""

    def __init__(
        self,
        *,
        counters: PullCounters,
        raw_stream: RawStream,
        channel_to: Callable[[str], grpc.Channel],
        max_chunk_bytes: int,
        pull_timeout_s: float,
        max_bytes: int,
        keep_s: float,
        thread_cpus: frozenset[int] = frozenset(),
        shm: ShmPuller | None = None,
    ) -> None:
        self._counters = counters
        self._raw_stream = raw_stream
        self._channel_to = channel_to
        self._max_chunk_bytes = max_chunk_bytes
        self._pull_timeout_s = pull_timeout_s
        self.max_bytes = max_bytes
        self.keep_s = keep_s
        self._shm = shm
        #: By request id (the gateway's, which the load's handle carries too).
        self.prefetches: dict[str, Prefetch] = {}
        self._num_staged_bytes = 0
        self._num_prefetching = 0
        self._loaded: OrderedDict[str, None] = OrderedDict()
        self._caches: list[torch.Tensor] = []
        self._block_dim = 0
        self._block_bytes = 0
        self._layout: KVLayout | None = None
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(
            max_workers=MAX_PREFETCHES_IN_FLIGHT,
            thread_name_prefix="tandem-kv-prefetch",
            initializer=move_this_thread,
            initargs=(thread_cpus,),
        )

    def start(self, caches: list[torch.Tensor], block_dim: int, layout: KVLayout) -> None:
        self._caches, self._block_dim, self._layout = caches, block_dim, layout
        self._block_bytes = wire.block_bytes_of(caches[0], block_dim) if caches else 0

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for prefetch in list(self.prefetches.values()):
            if prefetch.call is not None:
                prefetch.call.cancel()

    def prefetch(self, order: PrefetchOrder) -> str:
        """Start streaming ``order``'s prompt KV, computed with its adapter ("" for the base model), from the
        prefill engine at its ``kv_address`` (with the prompt's capability) into staging, skipping the whole
        blocks of its ``num_decode_cached_tokens`` (the prefix hit the router expects of this engine).
        Returns "" when started, else why not (the decode then pulls as usual)."""
        request_id, num_prompt_tokens = order.request_id, order.num_prompt_tokens
        layout = self._layout
        if layout is None:
            return "the KV caches are not registered yet"
        if self.max_bytes <= 0:
            return "prefetching is off (kv.prefetch_max_bytes is 0)"
        block_size = layout.block_size_tokens
        num_prompt_blocks = -(-num_prompt_tokens // block_size)
        first = min(order.num_decode_cached_tokens, num_prompt_tokens) // block_size
        num_blocks = num_prompt_blocks - first
        if num_blocks <= 0:
            return "nothing to prefetch"
        if request_id in self._loaded:
            return "the request's KV is loaded already (or it needed no load), or it was aborted here"
        num_staged_bytes = self._block_bytes * num_blocks * len(self._caches)
        self.drop(request_id, wasted=True)
        with self._lock:
            if self._num_prefetching >= MAX_PREFETCHES_IN_FLIGHT:
                return f"{MAX_PREFETCHES_IN_FLIGHT} prefetches are streaming already"
            if self._num_staged_bytes + num_staged_bytes > self.max_bytes:
                return (
                    f"staging is full ({self._num_staged_bytes} + {num_staged_bytes} bytes "
                    f"> kv.prefetch_max_bytes {self.max_bytes})"
                )
            self._num_staged_bytes += num_staged_bytes
            self._num_prefetching += 1
            self._counters.prefetches_started += 1
        prefetch = Prefetch(
            order=order,
            first_block_index=first,
            num_blocks=num_blocks,
            # Without shared memory the staging is this process's from the start; with it, only if the
            # shared-memory stream cannot be had (it stages in the peer's segment).
            staging=self._new_staging(num_blocks) if self._shm is None else None,
            num_staged_bytes=num_staged_bytes,
            expires_s=time.monotonic() + self.keep_s,
        )
        with self._lock:
            self.prefetches[request_id] = prefetch
        self._pool.submit(self._stream, prefetch)
        return ""

    def _new_staging(self, num_blocks: int) -> list[torch.Tensor]:
        shape = list(self._caches[0].shape)
        shape[self._block_dim] = num_blocks
        return [torch.empty(shape, dtype=cache.dtype, device=cache.device) for cache in self._caches]

    def _request(self, prefetch: Prefetch) -> kv_transfer_pb2.StreamBlocksRequest:
        assert self._layout is not None
        order = prefetch.order
        return kv_transfer_pb2.StreamBlocksRequest(
            request_id=order.request_id,
            first_block_index=prefetch.first_block_index,
            num_blocks=prefetch.num_blocks,
            expected_layout=self._layout.to_proto(),
            max_chunk_bytes=self._max_chunk_bytes,
            num_prompt_tokens=order.num_prompt_tokens,
            capability=order.capability,
            adapter=order.adapter,
        )

    def _set_call(self, prefetch: Prefetch, call: grpc.Call) -> None:
        """``call`` streams ``prefetch`` from now on: a drop cancels it (one that came first, at once)."""
        with self._lock:
            prefetch.call = call
            dropped = prefetch.dropped
        if dropped:
            call.cancel()
            raise RuntimeError("dropped")

    def _stream(self, prefetch: Prefetch) -> None:
        order = prefetch.order
        started = time.perf_counter()
        try:
            if self._shm is not None and self._stream_shm(prefetch):
                return
            with self._lock:
                if prefetch.staging is None and not prefetch.dropped:
                    prefetch.staging = self._new_staging(prefetch.num_blocks)
            call = self._raw_stream(order.kv_address, wire.STREAM_METHOD, self._request(prefetch))
            self._set_call(prefetch, call)
            staging = prefetch.staging
            if staging is None:  # dropped meanwhile
                raise RuntimeError("dropped")
            prefetch.num_bytes = wire.write_stream(staging, self._block_dim, prefetch.num_blocks, call)
        except Exception as exc:
            message = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            prefetch.error = str(message)[:500] or type(exc).__name__
            logger.info("KV prefetch of %s from %s: %s", order.request_id, order.kv_address, prefetch.error)
            self._free_staging(prefetch)
        finally:
            prefetch.seconds = time.perf_counter() - started
            with self._lock:
                self._num_prefetching -= 1
            prefetch.done.set()

    def _stream_shm(self, prefetch: Prefetch) -> bool:
        """Stream ``prefetch`` into a segment of its peer where the two share memory; True if staged there.
        False: stream it over gRPC (the peer shares none, or this failed: a fallback is counted). Raises what
        the gRPC stream would answer too (the prefill ended, no time left) and a drop."""
        assert self._shm is not None
        address = prefetch.order.kv_address
        channel = self._channel_to(address)
        if not self._shm.shares_with(channel, address):
            return False
        try:
            staged = shm_stream.stream(
                self._shm.memory,
                channel,
                self._request(prefetch),
                self._caches,
                self._block_dim,
                self.keep_s,
                lambda call: self._set_call(prefetch, call),
            )
        except grpc.RpcError:
            raise
        except Exception as exc:
            if prefetch.dropped:
                raise RuntimeError("dropped") from exc
            error = exc if isinstance(exc, shm.ShmError) else shm.ShmError("failed", f"{type(exc).__name__}: {exc}")
            self._shm.fall_back(address, prefetch.order.request_id, error, what="prefetch")
            if prefetch.call is not None:
                prefetch.call.cancel()  # gives the segment back, if the peer named one
            return False
        with self._lock:
            dropped = prefetch.dropped
            if not dropped:
                prefetch.staging, prefetch.shm, prefetch.num_bytes = staged.layers, staged, staged.num_bytes
        if dropped:
            staged.close()
            if prefetch.call is not None:
                prefetch.call.cancel()
            raise RuntimeError("dropped")
        self._shm.count_prefetch()
        return True

    def _free_staging(self, prefetch: Prefetch) -> None:
        """Free what ``prefetch`` staged, or holds room for (once), and give a peer's segment back."""
        with self._lock:
            prefetch.dropped = True
            staged, prefetch.shm, prefetch.staging = prefetch.shm, None, None
            self._num_staged_bytes -= prefetch.num_staged_bytes
            prefetch.num_staged_bytes = 0
        if staged is not None:
            staged.close()
            if prefetch.call is not None:
                prefetch.call.cancel()  # the peer's segment is given back with the call

    def abort(self, request_id: str) -> bool:
        """``request_id`` was aborted here, or its decode loads nothing: drop its prefetch, and refuse one
        that arrives later."""
        self.remember_done(request_id)
        return self.drop(request_id)

    def remember_done(self, request_id: str) -> None:
        with self._lock:
            self._loaded[request_id] = None
            while len(self._loaded) > _NUM_LOADED_REMEMBERED:
                self._loaded.popitem(last=False)

    def drop(self, request_id: str, *, wasted: bool = True) -> bool:
        """Forget ``request_id``'s prefetch (the request was aborted here, or is prefetched again):
        its stream is cancelled and its staging freed. True if there was one."""
        with self._lock:
            prefetch = self.prefetches.pop(request_id, None)
            if prefetch is not None and wasted:
                self._counters.prefetches_wasted += 1
        if prefetch is None:
            return False
        if prefetch.call is not None:
            prefetch.call.cancel()
        self._free_staging(prefetch)
        return True

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [(r, p) for r, p in self.prefetches.items() if p.expires_s <= now]
        for request_id, prefetch in expired:
            if not prefetch.error:  # a failed one was said already, and holds no staging
                logger.warning("KV prefetch of %s was not used in time; dropped", request_id)
            self.drop(request_id)

    def staged(self) -> tuple[int, int]:
        """(prefetches holding staging, their bytes) now. Drops the expired ones first: an idle engine
        steps no more, but its counters are still read (the heartbeat, GetLoad, GetStats)."""
        if self.prefetches:
            self.expire()
        with self._lock:
            return sum(1 for p in self.prefetches.values() if p.staging is not None), self._num_staged_bytes

    def take(self, request_id: str) -> Prefetch | None:
        with self._lock:
            return self.prefetches.pop(request_id, None)

    def load_from(self, spec: LoadSpec, prefetch: Prefetch) -> tuple[int, float] | None:
        """Copy ``spec``'s blocks from the prefetch's staging into the paged cache; (the bytes copied,
        seconds waited for the prefetch's stream to end), or None (the prefetch failed or does not cover
        them: the caller pulls)."""
        waited_from = time.perf_counter()
        usable = prefetch.done.wait(self._pull_timeout_s) and not prefetch.error
        waited_s = time.perf_counter() - waited_from
        staging, staged = prefetch.staging, prefetch.shm
        why = prefetch.error or "not finished in time"
        if usable and staging is not None:
            if not _same_prompt(prefetch, spec.handle):
                # Staged from another engine, request or capability than the handle names: not this
                # prompt's KV (a PrefetchKV forged by another caller, or a stale one).
                usable, why = False, "the prefetch is not of the prompt the handle names"
            elif prefetch.order.adapter != spec.handle.adapter:
                # Staged for another adapter's decode (or the base model's): other weights' KV.
                usable = False
                why = (
                    f"prefetched for adapter {prefetch.order.adapter or '(base model)'!r}, the load runs with "
                    f"{spec.handle.adapter or '(base model)'!r}"
                )
            elif prefetch.order.num_prompt_tokens != spec.handle.num_tokens:
                usable = False
                why = f"prefetched {prefetch.order.num_prompt_tokens} tokens, the handle has {spec.handle.num_tokens}"
            elif not prefetch.covers(spec.first_block_index, len(spec.local_block_ids)):
                usable, why = False, "the blocks to load were not prefetched (a prefix cache miss)"
        try:
            if not usable or staging is None:
                logger.info("KV prefetch of %s not used: %s", spec.handle.request_id, why)
                return None
            offset = spec.first_block_index - prefetch.first_block_index
            positions = range(offset, offset + len(spec.local_block_ids))
            copied = wire.copy_blocks(staging, positions, self._caches, spec.local_block_ids, self._block_dim)
            if staged is not None and time.monotonic() > staged.usable_until_s:
                # The peer may have given the segment to another stream while it was read: pull instead (the
                # pull writes the same blocks again).
                usable, why = False, "its shared-memory segment was kept past the prefill's lease"
                logger.info("KV prefetch of %s not used: %s", spec.handle.request_id, why)
                return None
            return copied, waited_s
        finally:
            with self._lock:
                if usable and staging is not None:
                    self._counters.prefetches_used += 1
                else:
                    self._counters.prefetches_wasted += 1
            if prefetch.call is not None and not prefetch.done.is_set():
                prefetch.call.cancel()
            self._free_staging(prefetch)
