"""Decode side of the worker-side connector: pulls a prefill engine's held
blocks into this engine's paged cache, on a small thread pool so that the
engine loop never waits on the network. Owns every pull and its figures;
holds nothing on the prefill side (holds are :mod:`kv_server`'s).

A prefetch is a pull started before the decode request exists (the gateway
asks for it when the request is placed, ``PrefetchKV``): it streams the
prompt's blocks from the prefill engine while that engine still computes them
(``StreamBlockBytes``, each chunk as its layers are saved) into a staging
buffer by block position. When the decode request's load comes, it waits for
the prefetch to finish (usually it has) and copies the blocks it needs from
staging into the paged cache: a local copy on the second token's critical
path instead of the network. A prefetch that failed, or does not cover the
blocks the load needs, is dropped and the load pulls as it would without one;
staging is bounded (``prefetch_max_bytes``) and freed when the load has copied
it, when the request is aborted here, when its decode needs no load (its
prompt was in this engine's prefix cache), or ``prefetch_keep_s`` after it
was started.

A prefetch names the LoRA adapter its decode will run with (``PrefetchKV``'s
``adapter``), and streams with it: the prefill engine's KV server refuses a
prompt it computes with another adapter, as it refuses such a pull. A load
whose handle names another adapter than its prefetch does not use what was
staged (counted wasted) and pulls, so staged KV of adapter A never serves a
decode of adapter B or of the base model.

The prefetch and the load name the prompt's KV by the same id, the gateway's
request id: ``PrefetchKV`` carries it, and the load's handle carries it from
the ``Decode`` (:mod:`params`). vLLM's id of the decode request
(``LoadSpec.engine_request_id``) only names the load towards vLLM's scheduler.

Two kinds of freeing happen here, under two names: *dropping a prefetch* frees
this engine's staging (:meth:`KVPuller.drop_prefetch`), and *releasing a hold*
asks the prefill engine to free the blocks it holds for the request
(:meth:`KVPuller.release_hold`, the ``Release`` call)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import Any, Final

import grpc
import grpc.experimental
import torch
from google.protobuf.message import Message

from tandem.common import kv_capability
from tandem.common.tls import RECONNECT_BACKOFF_OPTIONS, CredentialFiles, TLSSettings
from tandem.common.tls import channel as tls_channel
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import wire
from tandem.worker.kv_connector.cpus import move_this_thread
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.metadata import IDLE_STEP_WAIT_S, LoadSpec
from tandem.worker.kv_connector.params import KVHandleParams, LoadRecord, PrefetchOrder
from tandem.worker.kv_connector.shm_transport import ShmPuller

logger = logging.getLogger(__name__)

#: Client channels to other engines' KV servers: a prefill worker restarted on the same address is
#: dialled again within two seconds (gRPC's default backoff grows to two minutes). A pull's or a
#: prefetch's stream is read on the thread that iterates it (``SingleThreadedUnaryStream``), not handed
#: over message by message from the channel's own thread, which gRPC starts afresh for each call on an
#: idle channel: alternated in one process (2026-12-06), a 1-block pull took 4.09 ms against 4.58 ms, a
#: ~1k-token one the same. Cancelling such a stream from another thread (a dropped prefetch) still ends it.
CLIENT_OPTIONS: Final[list[tuple[str, Any]]] = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
    *RECONNECT_BACKOFF_OPTIONS,
]


#: Prefetches streaming at once (each holds a thread while its prefill runs); more are refused.
MAX_PREFETCHES_IN_FLIGHT = 8
#: Requests whose load pulled without a prefetch, or that were aborted here, remembered so that a
#: PrefetchKV arriving after its Decode's load or after its Abort (the gateway sends PrefetchKV in the
#: background: a request refused by its prefill worker is aborted here, and the Abort can overtake it)
#: is refused instead of staging KV nobody will use until prefetch_keep_s.
_NUM_LOADED_REMEMBERED = 1024


@dataclass
class PullCounters:
    bytes_received: int = 0
    blocks_received: int = 0
    kv_tokens_loaded: int = 0
    transfer_seconds: float = 0.0
    loads_failed: int = 0
    prefetches_started: int = 0
    prefetches_used: int = 0
    prefetches_wasted: int = 0


@dataclass
class _Prefetch:
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
    call: grpc.Call | None = None
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0

    def covers(self, first_block_index: int, num_blocks: int) -> bool:
        return (
            self.first_block_index <= first_block_index
            and first_block_index + num_blocks <= self.first_block_index + self.num_blocks
        )


def _same_prompt(prefetch: _Prefetch, handle: KVHandleParams) -> bool:
    """Whether ``prefetch`` streamed the KV ``handle`` names: the same prefill engine, request and
    capability."""
    order = prefetch.order
    return (
        order.kv_address == handle.kv_address
        and order.request_id == handle.request_id
        and kv_capability.matches(order.capability, handle.capability)
    )


class KVPuller:
    """Pulls for one engine rank (rank r dials port ``kv_port + r`` of the prefill worker)."""

    def __init__(
        self,
        *,
        tp_rank: int,
        max_chunk_bytes: int,
        pull_timeout_s: float,
        tls: TLSSettings,
        prefetch_max_bytes: int = 0,
        prefetch_keep_s: float = 60.0,
        thread_cpus: frozenset[int] = frozenset(),
        shm: ShmPuller | None = None,
    ) -> None:
        self._tp_rank = tp_rank
        #: Pulls from a peer of the same host and shared directory go through shared memory (None: off).
        self.shm = shm
        self._prefetch_max_bytes = prefetch_max_bytes
        self._prefetch_keep_s = prefetch_keep_s
        #: By request id (the gateway's, which the load's handle carries too).
        self._prefetches: dict[str, _Prefetch] = {}
        self._num_staged_bytes = 0
        self._num_prefetching = 0
        self._loaded: OrderedDict[str, None] = OrderedDict()
        self._max_chunk_bytes = max_chunk_bytes
        self._pull_timeout_s = pull_timeout_s
        self._tls = tls
        self._caches: list[torch.Tensor] = []
        self._block_dim = 0
        self._writer = wire.BlockWriter([], 0)
        self._layout: KVLayout | None = None
        self._lock = threading.Lock()
        self._load_finished = threading.Condition(self._lock)
        self._num_in_flight = 0
        self._failed_block_ids: set[int] = set()
        #: Loads that ended (done or failed), by vLLM's request id, with when (perf_counter), until a step
        #: reports them to vLLM's scheduler.
        self._ended: dict[str, tuple[LoadRecord, float]] = {}
        #: Reported loads' records, until the step's worker metadata takes them.
        self._records: dict[str, LoadRecord] = {}
        self.counters = PullCounters()
        # Pull threads (and the gRPC channels they dial) run on thread_cpus, off the engine's pinned
        # core (see :mod:`cpus`).
        self._pool = futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="tandem-kv-pull", initializer=move_this_thread, initargs=(thread_cpus,)
        )
        self._prefetch_pool = futures.ThreadPoolExecutor(
            max_workers=MAX_PREFETCHES_IN_FLIGHT,
            thread_name_prefix="tandem-kv-prefetch",
            initializer=move_this_thread,
            initargs=(thread_cpus,),
        )
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        #: After the certificate files change, pulls dial new channels (the old ones close once theirs end).
        self._files = CredentialFiles(tls)

    def start(self, caches: list[torch.Tensor], block_dim: int, layout: KVLayout) -> None:
        self._caches, self._block_dim, self._layout = caches, block_dim, layout
        self._writer = wire.BlockWriter(caches, block_dim)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._prefetch_pool.shutdown(wait=False, cancel_futures=True)
        for prefetch in list(self._prefetches.values()):
            if prefetch.call is not None:
                prefetch.call.cancel()
        for channel in self._channels.values():
            channel.close()

    # -- per step (engine loop) --------------------------------------------------

    def submit(self, loads: Iterable[LoadSpec], releases: Iterable[KVHandleParams]) -> None:
        """Start this step's loads (each releases its hold once done), and release the holds of
        ``releases`` (decode requests that load nothing)."""
        if self._prefetches:
            self._expire_prefetches()
        loads = list(loads)
        with self._lock:
            self._num_in_flight += len(loads)
        for spec in loads:
            self._pool.submit(self._load_and_release, spec)
        for handle in releases:
            # Its prompt was in this engine's prefix cache after all (the router expected less of it):
            # what a prefetch staged for it, or stages later, nobody will use.
            self.abort(handle.request_id)
            self._pool.submit(self.release_hold, handle)

    def take_results(self, *, idle_step: bool) -> tuple[set[str], set[str]]:
        """(loaded, failed) since the last call, by vLLM's request id. On a step with nothing else to
        do, wait a little for a load in flight first (see :data:`IDLE_STEP_WAIT_S`)."""
        with self._lock:
            if idle_step and self._num_in_flight and not self._ended:
                self._load_finished.wait(IDLE_STEP_WAIT_S)
            ended, self._ended = self._ended, {}
            now = time.perf_counter()
            done: set[str] = set()
            failed: set[str] = set()
            for request_id, (record, ended_at) in ended.items():
                (failed if record.failed else done).add(request_id)
                self._records[request_id] = replace(record, reported_after_s=now - ended_at)
        return done, failed

    def take_failed_block_ids(self) -> set[int]:
        with self._lock:
            ids, self._failed_block_ids = self._failed_block_ids, set()
        return ids

    def take_load_records(self) -> dict[str, LoadRecord]:
        """What each load reported since the last call (:meth:`take_results`) did, by vLLM request id."""
        with self._lock:
            records, self._records = self._records, {}
        return records

    # -- pulling (pool threads) --------------------------------------------------

    def _channel(self, handle: KVHandleParams) -> grpc.Channel:
        return self._channel_to(handle.kv_address)

    def _raw_stream(
        self, kv_address: str, method: str, request: Message, timeout_s: float | None = None
    ) -> grpc._CallIterator[bytes]:
        """A server stream of raw bytes (no response deserializer: see :mod:`wire`) from the KV server
        at ``kv_address``, under the pull timeout (or ``timeout_s``); iterate it for the messages, cancel
        it to stop."""
        call: grpc.UnaryStreamMultiCallable[Message, bytes] = self._channel_to(kv_address).unary_stream(
            method, request_serializer=type(request).SerializeToString, response_deserializer=None
        )
        return call(request, timeout=self._pull_timeout_s if timeout_s is None else timeout_s)

    def _channel_to(self, kv_address: str) -> grpc.Channel:
        host, _, port = kv_address.rpartition(":")
        address = f"{host}:{int(port) + self._tp_rank}"
        with self._channels_lock:
            if self._files.changed():
                for old in self._channels.values():
                    # Pulls under way keep their channel until their deadline (a daemon: never holds up exit).
                    closer = threading.Timer(self._pull_timeout_s + 1.0, old.close)
                    closer.daemon = True
                    closer.start()
                self._channels = {}
            channel = self._channels.get(address)
            if channel is None:
                channel = tls_channel(address, self._tls, options=list(CLIENT_OPTIONS))
                self._channels[address] = channel
        return channel

    # -- prefetches (the worker service through the engine; prefetch threads) ------

    def prefetch(self, order: PrefetchOrder) -> str:
        """Start streaming ``order``'s prompt KV, computed with its adapter ("" for the base model), from the
        prefill engine at its ``kv_address`` (with the prompt's capability) into staging, skipping the whole
        blocks of its ``num_decode_cached_tokens`` (the prefix hit the router expects of this engine).
        Returns "" when started, else why not (the decode then pulls as usual)."""
        request_id, num_prompt_tokens = order.request_id, order.num_prompt_tokens
        layout = self._layout
        if layout is None:
            return "the KV caches are not registered yet"
        if self._prefetch_max_bytes <= 0:
            return "prefetching is off (kv.prefetch_max_bytes is 0)"
        block_size = layout.block_size_tokens
        num_prompt_blocks = -(-num_prompt_tokens // block_size)
        first = min(order.num_decode_cached_tokens, num_prompt_tokens) // block_size
        num_blocks = num_prompt_blocks - first
        if num_blocks <= 0:
            return "nothing to prefetch"
        if request_id in self._loaded:
            return "the request's KV is loaded already (or it needed no load), or it was aborted here"
        num_staged_bytes = self._writer.block_bytes * num_blocks * len(self._caches)
        self.drop_prefetch(request_id, wasted=True)
        with self._lock:
            if self._num_prefetching >= MAX_PREFETCHES_IN_FLIGHT:
                return f"{MAX_PREFETCHES_IN_FLIGHT} prefetches are streaming already"
            if self._num_staged_bytes + num_staged_bytes > self._prefetch_max_bytes:
                return (
                    f"staging is full ({self._num_staged_bytes} + {num_staged_bytes} bytes "
                    f"> kv.prefetch_max_bytes {self._prefetch_max_bytes})"
                )
            self._num_staged_bytes += num_staged_bytes
            self._num_prefetching += 1
            self.counters.prefetches_started += 1
        shape = list(self._caches[0].shape)
        shape[self._block_dim] = num_blocks
        staging = [torch.empty(shape, dtype=cache.dtype, device=cache.device) for cache in self._caches]
        prefetch = _Prefetch(
            order=order,
            first_block_index=first,
            num_blocks=num_blocks,
            staging=staging,
            num_staged_bytes=num_staged_bytes,
            expires_s=time.monotonic() + self._prefetch_keep_s,
        )
        with self._lock:
            self._prefetches[request_id] = prefetch
        self._prefetch_pool.submit(self._stream_into_staging, prefetch)
        return ""

    def _stream_into_staging(self, prefetch: _Prefetch) -> None:
        assert self._layout is not None
        order = prefetch.order
        started = time.perf_counter()
        try:
            call = self._raw_stream(
                order.kv_address,
                wire.STREAM_METHOD,
                kv_transfer_pb2.StreamBlocksRequest(
                    request_id=order.request_id,
                    first_block_index=prefetch.first_block_index,
                    num_blocks=prefetch.num_blocks,
                    expected_layout=self._layout.to_proto(),
                    max_chunk_bytes=self._max_chunk_bytes,
                    num_prompt_tokens=order.num_prompt_tokens,
                    capability=order.capability,
                    adapter=order.adapter,
                ),
            )
            prefetch.call = call
            staging = prefetch.staging
            if staging is None:  # dropped before it started
                call.cancel()
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

    def _free_staging(self, prefetch: _Prefetch) -> None:
        with self._lock:
            if prefetch.staging is not None:
                prefetch.staging = None
                self._num_staged_bytes -= prefetch.num_staged_bytes

    def abort(self, request_id: str) -> bool:
        """``request_id`` was aborted here, or its decode loads nothing: drop its prefetch, and refuse one
        that arrives later."""
        with self._lock:
            self._remember_done(request_id)
        return self.drop_prefetch(request_id)

    def _remember_done(self, request_id: str) -> None:
        self._loaded[request_id] = None
        while len(self._loaded) > _NUM_LOADED_REMEMBERED:
            self._loaded.popitem(last=False)

    def drop_prefetch(self, request_id: str, *, wasted: bool = True) -> bool:
        """Forget ``request_id``'s prefetch (the request was aborted here, or is prefetched again):
        its stream is cancelled and its staging freed. True if there was one."""
        with self._lock:
            prefetch = self._prefetches.pop(request_id, None)
            if prefetch is not None and wasted:
                self.counters.prefetches_wasted += 1
        if prefetch is None:
            return False
        if prefetch.call is not None:
            prefetch.call.cancel()
        self._free_staging(prefetch)
        return True

    def _expire_prefetches(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [(r, p) for r, p in self._prefetches.items() if p.expires_s <= now]
        for request_id, prefetch in expired:
            if not prefetch.error:  # a failed one was said already, and holds no staging
                logger.warning("KV prefetch of %s was not used in time; dropped", request_id)
            self.drop_prefetch(request_id)

    def staged(self) -> tuple[int, int]:
        """(prefetches holding staging, their bytes) now. Drops the expired ones first: an idle engine
        steps no more, but its counters are still read (the heartbeat, GetLoad, GetStats)."""
        if self._prefetches:
            self._expire_prefetches()
        with self._lock:
            return sum(1 for p in self._prefetches.values() if p.staging is not None), self._num_staged_bytes

    def _take_prefetch(self, spec: LoadSpec) -> _Prefetch | None:
        with self._lock:
            return self._prefetches.pop(spec.handle.request_id, None)

    def _load_from_prefetch(self, spec: LoadSpec, prefetch: _Prefetch) -> tuple[int, float] | None:
        """Copy ``spec``'s blocks from the prefetch's staging into the paged cache; (the bytes copied,
        seconds waited for the prefetch's stream to end), or None (the prefetch failed or does not cover
        them: the caller pulls)."""
        waited_from = time.perf_counter()
        usable = prefetch.done.wait(self._pull_timeout_s) and not prefetch.error
        waited_s = time.perf_counter() - waited_from
        staging = prefetch.staging
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
            return wire.copy_blocks(staging, positions, self._caches, spec.local_block_ids, self._block_dim), waited_s
        finally:
            with self._lock:
                if usable and staging is not None:
                    self.counters.prefetches_used += 1
                else:
                    self.counters.prefetches_wasted += 1
            if prefetch.call is not None and not prefetch.done.is_set():
                prefetch.call.cancel()
            self._free_staging(prefetch)

    def _load_and_release(self, spec: LoadSpec) -> None:
        try:
            self.load(spec)
        finally:
            with self._lock:
                self._num_in_flight -= 1
        self.release_hold(spec.handle)

    def load(self, spec: LoadSpec) -> LoadRecord:
        """Pull ``spec``'s blocks into the paged cache; report it done (or failed) to the next step."""
        assert self._layout is not None, "load before register_kv_caches"
        started = time.perf_counter()
        num_bytes = 0
        error = ""
        prefetch = self._take_prefetch(spec) if self._prefetches else None
        copied = self._load_from_prefetch(spec, prefetch) if prefetch is not None else None
        if copied is not None:
            num_bytes, waited_s = copied
            return self._finish_load(spec, started, num_bytes, "", prefetched=True, prefetch_wait_s=waited_s)
        with self._lock:
            self._remember_done(spec.handle.request_id)
        chunk_bytes = wire.pull_chunk_bytes(
            self._writer.block_bytes * len(spec.remote_block_ids) * len(self._caches), self._max_chunk_bytes
        )
        request = kv_transfer_pb2.PullBlocksRequest(
            request_id=spec.handle.request_id,
            block_ids=list(spec.remote_block_ids),
            expected_layout=self._layout.to_proto(),
            max_chunk_bytes=chunk_bytes,
            capability=spec.handle.capability,
            adapter=spec.handle.adapter,
        )
        address = spec.handle.kv_address
        try:
            if self.shm is not None:  # a fallback pulls over gRPC within what is left of the pull's time
                channel, timeout_s = self._channel_to(address), self._pull_timeout_s
                shared = self.shm.pull(channel, address, request, self._writer, spec.local_block_ids, timeout_s)
                if shared is not None:
                    return self._finish_load(spec, started, shared, "", prefetched=False)
            left_s = self._pull_timeout_s - (time.perf_counter() - started)
            stream = self._raw_stream(address, wire.PULL_METHOD, request, timeout_s=max(0.1, left_s))
            num_bytes = self._writer.write_chunks(spec.local_block_ids, chunk_bytes, stream)
        except Exception as exc:
            message = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            logger.error("KV load of %s from %s failed: %s", spec.handle.request_id, spec.handle.kv_address, message)
            error = str(message)[:500] or type(exc).__name__
        return self._finish_load(spec, started, num_bytes, error, prefetched=False)

    def _finish_load(
        self,
        spec: LoadSpec,
        started: float,
        num_bytes: int,
        error: str,
        *,
        prefetched: bool,
        prefetch_wait_s: float = 0.0,
    ) -> LoadRecord:
        record = LoadRecord(
            num_kv_tokens_loaded=spec.num_tokens,
            num_blocks_loaded=len(spec.local_block_ids),
            num_bytes=num_bytes,
            seconds=time.perf_counter() - started,
            failed=bool(error),
            error=error,
            prefetched=prefetched,
            prefetch_wait_s=prefetch_wait_s,
        )
        with self._lock:
            c = self.counters
            c.bytes_received += num_bytes
            c.transfer_seconds += record.seconds
            if record.failed:
                c.loads_failed += 1
                self._failed_block_ids.update(spec.local_block_ids)
            else:
                c.blocks_received += record.num_blocks_loaded
                c.kv_tokens_loaded += spec.num_tokens
            self._ended[spec.engine_request_id] = (record, time.perf_counter())
            self._load_finished.notify_all()
        return record

    def release_hold(self, handle: KVHandleParams) -> None:
        """Release the prefill engine's hold on ``handle``'s blocks (``Release``): it may free them."""
        try:
            kv_transfer_pb2_grpc.KVTransferStub(self._channel(handle)).Release(
                kv_transfer_pb2.ReleaseBlocksRequest(request_id=handle.request_id, capability=handle.capability),
                timeout=5.0,
            )
        except grpc.RpcError as exc:
            # The lease on the prefill side frees the blocks anyway.
            logger.warning("releasing the hold of %s on %s failed: %s", handle.request_id, handle.kv_address, exc)
