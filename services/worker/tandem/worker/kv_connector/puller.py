"""Decode side of the worker-side connector: pulls a prefill engine's held
blocks into this engine's paged cache, on a small thread pool so that the
engine loop never waits on the network. Owns every pull and its figures;
holds nothing on the prefill side (holds are :mod:`kv_server`'s).

A load first looks for the request's prefetch (:mod:`prefetch`: its KV,
streamed while the prefill ran, copied from staging), else pulls: through
shared memory where the peer offers it on this host (:mod:`shm_transport`),
else, or when that fails, over gRPC.

vLLM's id of the decode request (``LoadSpec.engine_request_id``) only names
the load towards vLLM's scheduler; towards the prefill engine and the
prefetches the request is named by the gateway's request id, which the load's
handle carries.

Two kinds of freeing happen here, under two names: *dropping a prefetch* frees
this engine's staging (:meth:`KVPuller.drop_prefetch`), and *releasing a hold*
asks the prefill engine to free the blocks it holds for the request
(:meth:`KVPuller.release_hold`, the ``Release`` call)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Any, Final

import grpc
import grpc.experimental
import torch
from google.protobuf.message import Message

from tandem.common.tls import RECONNECT_BACKOFF_OPTIONS, CredentialFiles, TLSSettings
from tandem.common.tls import channel as tls_channel
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import wire
from tandem.worker.kv_connector.cpus import move_this_thread
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.metadata import IDLE_STEP_WAIT_S, LoadSpec
from tandem.worker.kv_connector.params import KVHandleParams, LoadRecord, PrefetchOrder
from tandem.worker.kv_connector.prefetch import Prefetcher
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
        #: Pulls and prefetches from a peer of the same host and shared directory go through shared memory
        #: (None: off).
        self.shm = shm
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
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        #: After the certificate files change, pulls dial new channels (the old ones close once theirs end).
        self._files = CredentialFiles(tls)
        #: The prefetches of this rank and their staging.
        self.prefetcher = Prefetcher(
            counters=self.counters,
            raw_stream=self._raw_stream,
            channel_to=self._channel_to,
            max_chunk_bytes=max_chunk_bytes,
            pull_timeout_s=pull_timeout_s,
            max_bytes=prefetch_max_bytes,
            keep_s=prefetch_keep_s,
            thread_cpus=thread_cpus,
            shm=shm,
        )

    def start(self, caches: list[torch.Tensor], block_dim: int, layout: KVLayout) -> None:
        self._caches, self._block_dim, self._layout = caches, block_dim, layout
        self._writer = wire.BlockWriter(caches, block_dim)
        self.prefetcher.start(caches, block_dim, layout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.prefetcher.shutdown()
        for channel in self._channels.values():
            channel.close()

    # -- per step (engine loop) --------------------------------------------------

    def submit(self, loads: Iterable[LoadSpec], releases: Iterable[KVHandleParams]) -> None:
        """Start this step's loads (each releases its hold once done), and release the holds of
        ``releases`` (decode requests that load nothing)."""
        if self.prefetcher.prefetches:
            self.prefetcher.expire()
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

    # -- prefetches (the worker service through the engine): see :mod:`prefetch` ------

    def prefetch(self, order: PrefetchOrder) -> str:
        """Start streaming ``order``'s prompt KV into staging; "" when started, else why not."""
        return self.prefetcher.prefetch(order)

    def abort(self, request_id: str) -> bool:
        """``request_id`` was aborted here, or its decode loads nothing: drop its prefetch, and refuse one
        that arrives later."""
        return self.prefetcher.abort(request_id)

    def drop_prefetch(self, request_id: str, *, wasted: bool = True) -> bool:
        """Forget ``request_id``'s prefetch: its stream is cancelled and its staging freed."""
        return self.prefetcher.drop(request_id, wasted=wasted)

    def staged(self) -> tuple[int, int]:
        """(prefetches holding staging, their bytes) now, the expired ones dropped first."""
        return self.prefetcher.staged()

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
        prefetcher = self.prefetcher
        prefetch = prefetcher.take(spec.handle.request_id) if prefetcher.prefetches else None
        copied = prefetcher.load_from(spec, prefetch) if prefetch is not None else None
        if copied is not None:
            num_bytes, waited_s = copied
            return self._finish_load(spec, started, num_bytes, "", prefetched=True, prefetch_wait_s=waited_s)
        prefetcher.remember_done(spec.handle.request_id)
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
