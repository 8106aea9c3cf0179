"""Decode side of the worker-side connector: pulls a prefill engine's held
blocks into this engine's paged cache, on a small thread pool so that the
engine loop never waits on the network. Owns every pull and its figures;
holds nothing (holds are :mod:`kv_server`'s)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from tandem.common.tls import RECONNECT_BACKOFF_OPTIONS, TLSSettings
from tandem.common.tls import channel as tls_channel
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import wire
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.metadata import LoadSpec
from tandem.worker.kv_connector.params import KVHandleParams, LoadRecord

logger = logging.getLogger(__name__)

#: Client channels to other engines' KV servers: a prefill worker restarted on the same address is
#: dialled again within two seconds (gRPC's default backoff grows to two minutes).
_CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    *RECONNECT_BACKOFF_OPTIONS,
]
#: How long an idle engine step (nothing scheduled, loads in flight) waits for a load to finish.
#: vLLM steps an engine that has only requests waiting for KV in a tight Python loop; in the
#: process that also runs the pull, that loop kept the GIL from the pull's threads (a 118 MB
#: pull took 125-930 ms on the live stack, 65 ms without the loop). Waiting on a condition
#: gives the GIL to the pull; a request that arrives meanwhile is scheduled at most this late.
IDLE_STEP_WAIT_S = 0.01


@dataclass
class PullCounters:
    bytes_received: int = 0
    blocks_received: int = 0
    kv_tokens_loaded: int = 0
    transfer_seconds: float = 0.0
    loads_failed: int = 0


class KVPuller:
    """Pulls for one engine rank (rank r dials port ``kv_port + r`` of the prefill worker)."""

    def __init__(self, *, tp_rank: int, max_chunk_bytes: int, pull_timeout_s: float, tls: TLSSettings) -> None:
        self._tp_rank = tp_rank
        self._max_chunk_bytes = max_chunk_bytes
        self._pull_timeout_s = pull_timeout_s
        self._tls = tls
        self._caches: list[torch.Tensor] = []
        self._block_dim = 0
        self._layout: KVLayout | None = None
        self._lock = threading.Lock()
        self._load_finished = threading.Condition(self._lock)
        self._num_in_flight = 0
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._failed_block_ids: set[int] = set()
        self._records: dict[str, LoadRecord] = {}
        self.counters = PullCounters()
        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="tandem-kv-pull")
        self._channels: dict[str, grpc.Channel] = {}

    def start(self, caches: list[torch.Tensor], block_dim: int, layout: KVLayout) -> None:
        self._caches, self._block_dim, self._layout = caches, block_dim, layout

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in self._channels.values():
            channel.close()

    # -- per step (engine loop) --------------------------------------------------

    def submit(self, loads: Iterable[LoadSpec], releases: Iterable[KVHandleParams]) -> None:
        loads = list(loads)
        with self._lock:
            self._num_in_flight += len(loads)
        for spec in loads:
            self._pool.submit(self._load_and_release, spec)
        for handle in releases:
            self._pool.submit(self.release_remote, handle)

    def take_results(self, *, idle_step: bool) -> tuple[set[str], set[str]]:
        """(loaded, failed) since the last call. On a step with nothing else to do, wait a little
        for a load in flight first (see :data:`IDLE_STEP_WAIT_S`)."""
        with self._lock:
            if idle_step and self._num_in_flight and not (self._done or self._failed):
                self._load_finished.wait(IDLE_STEP_WAIT_S)
            done, self._done = self._done, set()
            failed, self._failed = self._failed, set()
        return done, failed

    def take_failed_block_ids(self) -> set[int]:
        with self._lock:
            ids, self._failed_block_ids = self._failed_block_ids, set()
        return ids

    def take_load_records(self) -> dict[str, LoadRecord]:
        """What each load that ended since the last call did, by vLLM request id."""
        with self._lock:
            records, self._records = self._records, {}
        return records

    # -- pulling (pool threads) --------------------------------------------------

    def _channel(self, handle: KVHandleParams) -> grpc.Channel:
        host, _, port = handle.kv_address.rpartition(":")
        address = f"{host}:{int(port) + self._tp_rank}"
        channel = self._channels.get(address)
        if channel is None:
            channel = tls_channel(address, self._tls, options=list(_CLIENT_OPTIONS))
            self._channels[address] = channel
        return channel

    def _load_and_release(self, spec: LoadSpec) -> None:
        try:
            self.load(spec)
        finally:
            with self._lock:
                self._num_in_flight -= 1
        self.release_remote(spec.handle)

    def load(self, spec: LoadSpec) -> LoadRecord:
        """Pull ``spec``'s blocks into the paged cache; report it done (or failed) to the next step."""
        assert self._layout is not None, "load before register_kv_caches"
        started = time.perf_counter()
        num_bytes = 0
        error = ""
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
                    expected_layout=self._layout.to_proto(),
                    max_chunk_bytes=self._max_chunk_bytes,
                ),
                timeout=self._pull_timeout_s,
            )
            num_bytes = wire.write_chunks(
                self._caches, self._block_dim, spec.local_block_ids, self._max_chunk_bytes, stream
            )
        except Exception as exc:
            message = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            logger.error("KV load of %s from %s failed: %s", spec.request_id, spec.handle.kv_address, message)
            error = str(message)[:500] or type(exc).__name__
        record = LoadRecord(
            num_kv_tokens_loaded=spec.num_tokens,
            num_blocks_loaded=len(spec.local_block_ids),
            num_bytes=num_bytes,
            seconds=time.perf_counter() - started,
            failed=bool(error),
            error=error,
        )
        with self._lock:
            c = self.counters
            c.bytes_received += num_bytes
            c.transfer_seconds += record.seconds
            if record.failed:
                c.loads_failed += 1
                self._failed.add(spec.request_id)
                self._failed_block_ids.update(spec.local_block_ids)
            else:
                c.blocks_received += record.num_blocks_loaded
                c.kv_tokens_loaded += spec.num_tokens
                self._done.add(spec.request_id)
            self._records[spec.request_id] = record
            self._load_finished.notify_all()
        return record

    def release_remote(self, handle: KVHandleParams) -> None:
        """Tell the prefill engine it may free the blocks it holds for ``handle``."""
        try:
            kv_transfer_pb2_grpc.KVTransferStub(self._channel(handle)).Release(
                kv_transfer_pb2.ReleaseBlocksRequest(remote_request_id=handle.remote_request_id), timeout=5.0
            )
        except grpc.RpcError as exc:
            # The lease on the prefill side frees the blocks anyway.
            logger.warning("releasing %s on %s failed: %s", handle.remote_request_id, handle.kv_address, exc)
