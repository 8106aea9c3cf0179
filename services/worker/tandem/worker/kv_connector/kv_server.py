"""Prefill side of the worker-side connector: the one owner of held KV.

The scheduler-side connector announces each hold (blocks and lease expiry)
through the step metadata; this server keeps it until the decode engine
releases it (``Release``, after its pull), the worker service releases it
(an abort) or its lease expires, then reports the request done sending so
that vLLM frees the blocks.

A hold is named two ways, each on its own side: by vLLM's request id towards
the engine (the step metadata, and the ids reported done sending), and by the
gateway's request id towards every caller (``PullBlockBytes``,
``StreamBlockBytes``, ``Release``, the worker service's abort), kept in one
index beside the records. Should one request id be prefilled twice here, the
later prefill is the one callers reach; the earlier is freed by its lease or
with its request.

Before a hold is announced, while its prompt is still being prefilled, the
same record tracks how far each layer's KV is computed (the step metadata's
``progress``, advanced layer by layer from ``save_kv_layer``): then its
blocks belong to the engine's running request, it has no lease, and it ends
with the request, as a hold or not at all (``ended``: stopped at its first
token, aborted, preempted). ``StreamBlockBytes`` serves such a prompt chunk by
chunk as each becomes ready, so that a decode engine's pull overlaps the
prefill.

It serves ``tandem.v1.KVTransfer`` on its own threads (the methods are
:mod:`kv_servicer`'s): ``PullBlockBytes`` and ``StreamBlockBytes`` (raw bytes,
see :mod:`wire`), ``PullBlocksShm`` and ``DataPaths`` (:mod:`shm_transport`), ``StreamBlocksShm``
(:mod:`shm_stream`),
``Release``, and ``Describe``/``GetStats`` for people and tools. With internal TLS on, only a
decode worker's certificate may call the first four (GetStats: any role; see
:data:`tandem.common.identity.ALLOWED_ROLES`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from tandem.common import kv_capability
from tandem.common.identity import sync_role_checks
from tandem.common.tls import TLSSettings, add_port
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import shm_transport, wire
from tandem.worker.kv_connector.cpus import move_this_thread, threads_started_on
from tandem.worker.kv_connector.kv_servicer import KVTransferServicer
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.metadata import IDLE_STEP_WAIT_S, HoldSpec, PrefillProgress

logger = logging.getLogger(__name__)

_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # so_reuseport off: a port someone else holds must fail the bind, not share its traffic.
    ("grpc.so_reuseport", 0),
]
#: How long PullBlockBytes waits for a hold the scheduler has not announced yet.
_HOLD_ANNOUNCE_WAIT_S = 5.0
#: A stream waiting for its prompt to be scheduled or computed looks at its call this often (a caller
#: that gave up ends the wait).
_STREAM_POLL_S = 0.5
#: Request ids of the last prompts that ended or were freed, so that a stream arriving after its prompt
#: is gone ends at once instead of waiting for it until its deadline.
_NUM_GONE_REMEMBERED = 4096


@dataclass
class Hold:
    """One request's blocks: still being prefilled (``expiry_unix_s`` None, ``ready_tokens`` per
    layer), or held for a decode engine under a lease (``ready_tokens`` None: every layer is ready)."""

    block_ids: tuple[int, ...]
    expiry_unix_s: float | None
    #: The gateway's request id: what callers name it by.
    request_id: str = ""
    num_prompt_tokens: int = 0
    ready_tokens: list[int] | None = None
    #: Prompt tokens computed once this step's forward has saved a layer (while prefilling).
    step_tokens: int = 0
    #: Device caches: the event recorded after each layer was saved (a reader waits for it).
    ready_events: list[torch.cuda.Event | None] = field(default_factory=list)
    #: Released, expired or ended: the blocks may hold another request's KV from now on.
    gone: bool = False
    #: Released while still being prefilled (a decode engine that loaded it from a prefetch can be
    #: quicker than the announcement): freed as soon as it is announced.
    release_on_announce: bool = False
    #: What a caller must present to read or release it (tandem.common.kv_capability); "" for none: then
    #: no gRPC call may (only the engine's own abort frees it).
    capability: str = field(default="", repr=False)
    #: The LoRA adapter the blocks are computed with (while prefilling and once held; "" for the base model).
    adapter: str = ""

    @property
    def announced(self) -> bool:
        """Held for a decode engine (not still being prefilled)."""
        return self.expiry_unix_s is not None

    def ready(self, layer_index: int, num_tokens: int) -> bool:
        return self.ready_tokens is None or self.ready_tokens[layer_index] >= num_tokens


@dataclass
class ServeCounters:
    bytes_sent: int = 0
    blocks_sent: int = 0
    leases_expired: int = 0
    streams_served: int = 0


def _ready_blocks(num_tokens: int, num_prompt_tokens: int, block_size: int) -> int:
    """Blocks of a prompt whose tokens are all computed (the last, partial block once the whole prompt is)."""
    if num_tokens >= num_prompt_tokens:
        return -(-num_prompt_tokens // block_size)
    return num_tokens // block_size


class KVServer:
    """Holds and serves one engine rank's blocks on ``bind`` (``host:kv_port + rank``)."""

    def __init__(
        self,
        *,
        bind: str,
        tls: TLSSettings,
        thread_cpus: frozenset[int] = frozenset(),
        shm: shm_transport.SharedMemory | None = None,
    ) -> None:
        self._bind = bind
        #: The shared-memory data path (None: gRPC only); its segments are freed with their holds.
        self.shm = shm
        self._tls = tls
        #: CPUs the serving threads run on (see :mod:`cpus`; empty: where they were started).
        self._thread_cpus = thread_cpus
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        #: By vLLM's request id (what the engine announces and is told done sending).
        self._holds: dict[str, Hold] = {}
        #: The gateway's request id → vLLM's, for the records callers can reach.
        self._by_request_id: dict[str, str] = {}
        #: Request ids of prompts that ended or were freed lately (oldest first).
        self._gone: OrderedDict[str, None] = OrderedDict()
        #: Prompts computed further in the step running now (their layers advance as they are saved).
        self._stepping: list[Hold] = []
        self._done_sending: set[str] = set()
        self._seen_finished: set[str] = set()
        self.counters = ServeCounters()
        self._caches: list[torch.Tensor] = []
        self._block_dim = 0
        self._reader = wire.BlockReader([], 0)
        self._on_device = False
        self.layout: KVLayout | None = None
        self._server: grpc.Server | None = None
        self._pool: futures.ThreadPoolExecutor | None = None

    def start(
        self,
        caches: list[torch.Tensor],
        block_dim: int,
        layout: KVLayout,
        stats: Callable[[], kv_transfer_pb2.KVStats],
    ) -> None:
        """Serve ``caches`` (one tensor per layer, in layer order); ``stats`` answers GetStats."""
        self._caches, self._block_dim, self.layout = caches, block_dim, layout
        self._reader = wire.BlockReader(caches, block_dim)
        self._on_device = bool(caches) and caches[0].device.type == "cuda"
        # A stream through shared memory keeps its thread until its decode has loaded (it holds a segment
        # meanwhile): one more thread per segment, so that those never hold up pulls and releases.
        self._pool = futures.ThreadPoolExecutor(
            max_workers=8 + (self.shm.pool.max_segments if self.shm is not None else 0),
            thread_name_prefix="tandem-kv-serve",
            initializer=move_this_thread,
            initargs=(self._thread_cpus,),
        )
        with threads_started_on(self._thread_cpus):  # gRPC's pollers and the serving loop
            # With TLS on, only decode workers' certificates read or release KV (tandem.common.identity).
            server = grpc.server(self._pool, options=_SERVER_OPTIONS, interceptors=sync_role_checks(self._tls.enabled))
            servicer = KVTransferServicer(self, stats)
            kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
            server.add_generic_rpc_handlers((servicer.raw_handlers(),))
            if add_port(server, self._bind, self._tls) == 0:
                raise RuntimeError(f"KV transfer server cannot bind {self._bind}")
            server.start()
        self._server = server

    @property
    def caches(self) -> list[torch.Tensor]:
        """This rank's cache tensors, in layer order."""
        return self._caches

    @property
    def block_dim(self) -> int:
        return self._block_dim

    @property
    def address(self) -> str:
        """Where this rank's KV server listens (``host:port``)."""
        return self._bind

    def shutdown(self) -> None:
        if self._server is not None:
            # Streams still waiting for a prefill end at once (their callers see CANCELLED); the pool
            # goes only once the server has let go of it.
            self._server.stop(grace=0.5).wait(2.0)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.shm is not None:
            self.shm.close()

    def _find(self, request_id: str) -> tuple[str, Hold | None]:
        """(vLLM's id, record) of the prompt the gateway named ``request_id`` (the lock held)."""
        engine_request_id = self._by_request_id.get(request_id, "")
        return engine_request_id, self._holds.get(engine_request_id)

    def _add(self, engine_request_id: str, hold: Hold) -> None:
        """Keep ``hold`` as vLLM's ``engine_request_id`` (the lock held); callers reach it by its request id."""
        self._holds[engine_request_id] = hold
        self._by_request_id[hold.request_id] = engine_request_id
        self._gone.pop(hold.request_id, None)

    def _remove(self, engine_request_id: str) -> Hold:
        """Drop the record of vLLM's ``engine_request_id`` (the lock held): whoever reads its blocks must stop."""
        hold = self._holds.pop(engine_request_id)
        hold.gone = True
        if self.shm is not None:
            self.shm.pool.release_owner(hold.request_id)
        if self._by_request_id.get(hold.request_id) == engine_request_id:
            del self._by_request_id[hold.request_id]
        self._gone[hold.request_id] = None
        while len(self._gone) > _NUM_GONE_REMEMBERED:
            self._gone.popitem(last=False)
        self._changed.notify_all()
        return hold

    # -- per step (engine loop) --------------------------------------------------

    def hold(self, holds: dict[str, HoldSpec]) -> None:
        """Keep the blocks the scheduler-side connector announced this step (by vLLM's request id)."""
        if not holds:
            return
        with self._lock:
            for req_id, spec in holds.items():
                hold = self._holds.get(req_id)
                if hold is not None and not hold.announced:
                    # The prompt was being streamed: the same record, now held under a lease (a stream
                    # reading it goes on with every layer ready).
                    hold.block_ids, hold.expiry_unix_s, hold.ready_tokens = (
                        spec.block_ids,
                        spec.lease_expires_unix_s,
                        None,
                    )
                    hold.capability = spec.capability
                    hold.adapter = spec.adapter
                    if hold.release_on_announce:
                        self._remove(req_id)
                        self._done_sending.add(req_id)
                else:
                    self._add(
                        req_id,
                        Hold(
                            spec.block_ids,
                            spec.lease_expires_unix_s,
                            request_id=spec.request_id,
                            capability=spec.capability,
                            adapter=spec.adapter,
                        ),
                    )
            self._changed.notify_all()

    def progress(self, updates: Iterable[PrefillProgress], ended: Iterable[str]) -> None:
        """Before a step's forward pass: prompts it computes further, and prompts that ended without a
        hold (their blocks may be written by this very step, so a stream reading them must stop).
        Called every step: a step that computes no streamed prompt clears the last one's."""
        if not (updates or ended or self._stepping):
            return
        with self._lock:
            self._stepping = []
            for req_id in ended:
                hold = self._holds.get(req_id)
                if hold is not None and not hold.announced:
                    self._remove(req_id)
            for update in updates:
                hold = self._holds.get(update.engine_request_id)
                if hold is None:
                    num_layers = len(self._caches)
                    hold = Hold(
                        block_ids=update.block_ids,
                        expiry_unix_s=None,
                        request_id=update.request_id,
                        num_prompt_tokens=update.num_prompt_tokens,
                        ready_tokens=[update.num_computed_tokens] * num_layers,
                        ready_events=[None] * num_layers,
                        capability=update.capability,
                        adapter=update.adapter,
                    )
                    self._add(update.engine_request_id, hold)
                elif hold.announced:
                    continue
                hold.block_ids = update.block_ids
                hold.step_tokens = update.num_computed_after_step
                self._stepping.append(hold)
            self._changed.notify_all()

    def layer_saved(self, layer_index: int) -> None:
        """The running step's forward pass has written layer ``layer_index``'s KV (``save_kv_layer``)."""
        if not self._stepping:
            return
        event: torch.cuda.Event | None = None
        if self._on_device:
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            for hold in self._stepping:
                if hold.ready_tokens is not None:
                    hold.ready_tokens[layer_index] = hold.step_tokens
                    hold.ready_events[layer_index] = event
            self._changed.notify_all()

    def take_done_sending(self, finished_req_ids: set[str], *, idle_step: bool = False) -> set[str]:
        """Requests whose blocks vLLM may free now: released, or past their lease. On a step with
        nothing else to do (the engine steps only to hear of releases), wait a little for one first
        (see :data:`IDLE_STEP_WAIT_S`)."""
        with self._lock:
            if idle_step and not self._done_sending and any(h.announced for h in self._holds.values()):
                self._changed.wait(IDLE_STEP_WAIT_S)
            now = time.time()
            self._seen_finished |= finished_req_ids
            for req_id, hold in list(self._holds.items()):
                if hold.expiry_unix_s is not None and hold.expiry_unix_s <= now:
                    self._remove(req_id)
                    self._done_sending.add(req_id)
                    self.counters.leases_expired += 1
                    logger.warning("KV lease of %s expired before a decode engine released it", hold.request_id)
            # vLLM only accepts ids it has already reported finished to us.
            sending = {r for r in self._done_sending if r in self._seen_finished}
            self._done_sending -= sending
            self._seen_finished -= sending
        return sending

    # -- serving (KV server threads, and the worker service through the engine) ---

    def wait_for_hold(self, request_id: str) -> Hold | None:
        """The announced hold of ``request_id``, waiting a little for its announcement."""
        deadline = time.monotonic() + _HOLD_ANNOUNCE_WAIT_S
        with self._lock:
            while (hold := self._find(request_id)[1]) is None or not hold.announced:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)
            return hold

    def find_prompt(self, request_id: str, is_active: Callable[[], bool]) -> Hold | None:
        """The record of the prompt of ``request_id`` (prefilling or held), waiting until the engine
        schedules it; a record already ``gone`` if the prompt ended or was freed before; None once
        ``is_active`` says the caller gave up."""
        with self._lock:
            while True:
                _, hold = self._find(request_id)
                if hold is not None:
                    return hold
                if request_id in self._gone:
                    return Hold(block_ids=(), expiry_unix_s=None, gone=True)
                if not is_active():
                    return None
                self._changed.wait(_STREAM_POLL_S)

    def wait_progress(
        self,
        hold: Hold,
        sent: list[int],
        block_range: tuple[int, int],
        is_active: Callable[[], bool],
    ) -> list[int] | None:
        """Per layer, how many of the prompt's blocks ``[first, first + n)`` of ``block_range`` are
        computed, once some layer has more than ``sent``; None when the prompt ended without a hold
        or the caller gave up. Device caches: waits for the layers' saves to have happened."""
        first, num_blocks = block_range
        block_size = self.layout.block_size_tokens if self.layout is not None else 1
        with self._lock:
            while True:
                if hold.gone or not is_active():
                    return None
                if hold.ready_tokens is None:
                    ready = [num_blocks] * len(sent)
                else:
                    ready = [
                        max(0, min(num_blocks, _ready_blocks(tokens, hold.num_prompt_tokens, block_size) - first))
                        for tokens in hold.ready_tokens
                    ]
                if any(r > s for r, s in zip(ready, sent, strict=True)):
                    events = list(hold.ready_events) if hold.ready_tokens is not None else []
                    break
                self._changed.wait(_STREAM_POLL_S)
        for event in events:
            if event is not None:
                event.synchronize()
        return ready

    def release_hold(self, request_id: str, *, capability: str | None = None) -> bool:
        """Release the hold of ``request_id``'s prompt: its blocks are freed. A prompt still being
        prefilled is the engine's: it is freed when it is announced, or ends with its request without
        one. A caller over gRPC must present the prompt's ``capability`` (None: the engine's own abort,
        through the worker service)."""
        with self._lock:
            req_id, hold = self._find(request_id)
            if hold is None or (capability is not None and not kv_capability.matches(hold.capability, capability)):
                return False
            if not hold.announced:
                hold.release_on_announce = True
                return True
            self._remove(req_id)
            self._done_sending.add(req_id)
            return True

    def held(self) -> tuple[int, int]:
        """(requests, blocks) held now for a decode engine."""
        with self._lock:
            holds = [h for h in self._holds.values() if h.announced]
            return len(holds), sum(len(h.block_ids) for h in holds)

    def num_prefilling(self) -> int:
        """Prompts being prefilled now whose KV may be streamed."""
        with self._lock:
            return sum(1 for h in self._holds.values() if not h.announced)

    def reader(self) -> wire.BlockReader:
        """A reader of the cache: the one built at start where threads may share it (CPU caches), else
        one of the caller's own."""
        if self._reader.shareable:
            return self._reader
        return wire.BlockReader(self._caches, self._block_dim)

    def read_chunks(self, block_ids: list[int], max_chunk_bytes: int) -> Iterator[bytes]:
        """All requested blocks as :mod:`wire` chunks, in wire order."""
        return self.reader().chunks(block_ids, max_chunk_bytes)

    def count_sent(self, num_bytes: int, num_blocks: int, *, streamed: bool = False) -> None:
        with self._lock:
            self.counters.bytes_sent += num_bytes
            self.counters.blocks_sent += num_blocks
            self.counters.streams_served += int(streamed)
