"""Worker-side half of the gRPC KV connector; runs in vLLM's model-runner
process, next to the KV tensors.

It derives the block layout from the live tensors (``register_kv_caches``),
then hands each step's work to its two parts: :mod:`kv_server` (prefill:
holds, leases, serving blocks, streaming a prompt's blocks layer by layer as
the forward pass saves them) and :mod:`puller` (decode: pulls into the paged
cache, prefetches into staging while the prefill runs, and what each pull
did). :mod:`extension` exposes it to the worker service through the engine
(layout, counters, an abort: its hold released or its prefetch dropped,
starting a prefetch).
"""

from __future__ import annotations

import logging
import re

import torch

from tandem.common import failpoints
from tandem.common.errors import KVLayoutMismatchError
from tandem.common.tls import TLSSettings
from tandem.v1 import kv_transfer_pb2
from tandem.worker.kv_connector import heap
from tandem.worker.kv_connector.kv_server import KVServer
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, LoadSpec
from tandem.worker.kv_connector.params import LoadRecord, PrefetchOrder
from tandem.worker.kv_connector.puller import KVPuller
from tandem.worker.kv_connector.shm_transport import SharedMemory, ShmPuller

logger = logging.getLogger(__name__)


def _layer_sort_key(name: str) -> tuple[int, str]:
    match = re.search(r"\.(\d+)\.", name) or re.search(r"(\d+)", name)
    return (int(match.group(1)) if match else -1, name)


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
        lease_s: float = 60.0,
        prefetch_max_bytes: int = 0,
        tls: TLSSettings | None = None,
        thread_cpus: frozenset[int] = frozenset(),
        shm_dir: str = "",
        shm_max_segments: int = 4,
        node_name: str = "",
        model_revision: str = "",
    ) -> None:
        self._model = model
        self._model_revision = model_revision
        self._num_blocks = num_blocks
        self._block_size_tokens = block_size_tokens
        self._tp_size = tp_size
        tls = tls or TLSSettings()
        heap.keep_message_buffers(max_chunk_bytes)
        #: The shared-memory data path (:mod:`shm_transport`), where a directory is given.
        self.shm: SharedMemory | None = None
        if shm_dir:
            try:
                self.shm = SharedMemory(shm_dir, max_segments=shm_max_segments, max_age_s=lease_s, node_name=node_name)
            except OSError as exc:
                logger.warning("shared memory in %s is not usable (%s): KV over gRPC only", shm_dir, exc)
        self.server = KVServer(bind=f"{kv_host}:{kv_port + tp_rank}", tls=tls, thread_cpus=thread_cpus, shm=self.shm)
        self.puller = KVPuller(
            tp_rank=tp_rank,
            max_chunk_bytes=max_chunk_bytes,
            pull_timeout_s=pull_timeout_s,
            tls=tls,
            prefetch_max_bytes=prefetch_max_bytes,
            prefetch_keep_s=lease_s,
            thread_cpus=thread_cpus,
            shm=ShmPuller(self.shm) if self.shm is not None else None,
        )
        self._idle_step = False
        #: Layer name (as vLLM's attention layers call save_kv_layer) → index in layer order.
        self._layer_index: dict[str, int] = {}
        self.layout: KVLayout | None = None

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
        block_dim = dims[0]
        for name, tensor in layers:
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise KVLayoutMismatchError(
                    f"layer {name} has KV shape {tuple(tensor.shape)} {tensor.dtype}, "
                    f"expected {tuple(first.shape)} {first.dtype}"
                )
        block_shape = tuple(int(d) for i, d in enumerate(first.shape) if i != block_dim)
        layout = KVLayout(
            model=self._model,
            dtype=str(first.dtype).removeprefix("torch."),
            block_size_tokens=self._block_size_tokens,
            num_layers=len(layers),
            block_shape=block_shape,
            tp_size=self._tp_size,
            block_dim=block_dim,
            model_revision=self._model_revision,
        )
        caches = [cache for _, cache in layers]
        self._layer_index = {name: i for i, (name, _) in enumerate(layers)}
        self.server.start(caches, block_dim, layout, self.stats)
        self.puller.start(caches, block_dim, layout)
        self.layout = layout
        logger.info(
            "KV transfer server ready: %d layers, block %s %s, block dim %d of %s",
            len(layers),
            block_shape,
            layout.dtype,
            block_dim,
            tuple(first.shape),
        )

    def shutdown(self) -> None:
        self.server.shutdown()
        self.puller.shutdown()

    # -- per step (engine loop) --------------------------------------------------

    def begin_step(self, meta: GrpcKVMetadata) -> None:
        """A step's work from its connector metadata, before its forward pass (the connector calls this
        when vLLM binds the metadata: vLLM's own ``start_load_kv`` comes after the forward): new holds, a
        running prefill's progress and the prompts that ended, loads to start, holds to release."""
        failpoints.hit("engine.step")
        self.server.hold(meta.holds)
        self.server.progress(meta.progress, meta.ended)
        self._idle_step = meta.idle_step
        self.puller.submit(meta.loads, meta.releases)

    def layer_saved(self, layer_name: str) -> None:
        """The forward pass has written this layer's KV for the step (``save_kv_layer``)."""
        index = self._layer_index.get(layer_name)
        if index is not None:
            self.server.layer_saved(index)

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(done sending, done receiving, failed receiving) since the last call; a failed load is
        also done receiving."""
        loaded, failed = self.puller.take_results(idle_step=self._idle_step)
        sending = self.server.take_done_sending(finished_req_ids, idle_step=self._idle_step)
        return sending, loaded | failed, failed

    def take_failed_block_ids(self) -> set[int]:
        return self.puller.take_failed_block_ids()

    def take_load_records(self) -> dict[str, LoadRecord]:
        return self.puller.take_load_records()

    # -- for the worker service (through the engine) and GetStats ------------------

    def abort(self, request_id: str) -> bool:
        """``request_id`` was aborted: release its hold on blocks kept for a decode engine (prefill),
        drop its prefetch's staging (decode). True if there was either."""
        released = self.server.release_hold(request_id)
        return self.puller.abort(request_id) or released

    def prefetch(self, order: PrefetchOrder) -> str:
        """Start streaming a running prefill's KV into staging as ``order`` says; "" if started, else why
        not."""
        return self.puller.prefetch(order)

    def load(self, spec: LoadSpec) -> LoadRecord:
        """Pull one request's blocks now, on the calling thread (benchmarks)."""
        return self.puller.load(spec)

    def stats(self) -> kv_transfer_pb2.KVStats:
        num_staged, staged_bytes = self.puller.staged()  # first: it drops expired prefetches
        served, pulled = self.server.counters, self.puller.counters
        num_held_requests, num_held_blocks = self.server.held()
        msg = kv_transfer_pb2.KVStats(
            bytes_sent_total=served.bytes_sent,
            bytes_received_total=pulled.bytes_received,
            blocks_sent_total=served.blocks_sent,
            blocks_received_total=pulled.blocks_received,
            kv_tokens_loaded_total=pulled.kv_tokens_loaded,
            transfer_seconds_total=pulled.transfer_seconds,
            loads_failed_total=pulled.loads_failed,
            leases_expired_total=served.leases_expired,
            num_held_requests=num_held_requests,
            num_held_blocks=num_held_blocks,
            prefetches_started_total=pulled.prefetches_started,
            prefetches_used_total=pulled.prefetches_used,
            prefetches_wasted_total=pulled.prefetches_wasted,
        )
        msg.num_staged_prefetches, msg.staged_bytes = num_staged, staged_bytes
        if self.puller.shm is not None:
            msg.shm_loads_total = self.puller.shm.num_loads
            msg.shm_prefetches_total = self.puller.shm.num_prefetches
            msg.shm_fallbacks_total.update(self.puller.shm.fallbacks)
        if self.layout is not None:
            msg.layout.CopyFrom(self.layout.to_proto())
        return msg
