"""The engine's KV-event feed and replay socket, served on the worker's address without prompt data.

vLLM's ``BlockStored`` events carry the prompt's token ids (and, in ``extra_keys``, the tenant's
cache salt, multimodal identifiers and prompt-embedding digests): anything that subscribed to the
engine's publisher, or asked its replay socket, would read every tenant's recent prompts. The
router needs none of it: :mod:`tandem.common.kv_events` reads the block hashes, the parent hash, the
block size, the medium and the *number* of token ids. So the engine never listens on the network
itself: it publishes and replays on two private ipc sockets in this worker's temp folder, and
:class:`KVEventRelay` (one thread of the worker process) serves both on ``tcp://<host>:<port>``:

- live feed: SUB (connected to the engine's PUB) → PUB (bound on the worker's address). Each
  message keeps vLLM's framing, ``(topic, seq as 8 bytes big-endian, payload)``, topic and
  sequence frames forwarded as they came; only the payload is rewritten by :class:`BatchRedactor`.
- replay: ROUTER (bound on the worker's address) → one DEALER per client (connected to the engine's
  replay ROUTER, ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._service_replay``). vLLM
  takes ``(client id, b"", start seq)`` and answers ``(client id, b"", topic, seq, payload)`` per
  buffered batch, then ``(client id, b"", b"", END_SEQ, b"")``; the relay forwards each request on
  that client's DEALER and each answer back to the client, payloads redacted, the end marker as is.
  A DEALER per client keeps answers apart exactly as a direct connection would (a client that
  reconnects gets a new id, so an old answer never reaches its new request); one idle for
  ``REPLAY_IDLE_S`` is closed, and past ``MAX_REPLAY_CLIENTS`` the least recently active goes.

:class:`BatchRedactor` decodes a payload with vLLM's own msgspec types, replaces each
``BlockStored.token_ids`` with as many zeros (the router's decoder, unchanged, reads the same
count, and so would any consumer of a stock publisher) and keeps only the fields that are not
request data: ``extra_keys`` and ``session_id`` are dropped. A payload that does not decode is
dropped, never forwarded (the subscriber sees a gap, asks for a replay, and counts the batch as
unrepaired). The host may be a wildcard (``0.0.0.0``): the relay binds all interfaces then, and
events are redacted all the same.

Cost (``.venv/bin/python benchmarks/kv_events_relay.py``, two runs on the 2-core dev VM at load ~5,
2026-12-06): redacting a batch of one ``BlockStored`` takes 2.5-4.5 us for 4 blocks x 16 tokens
(234 B) and 50-61 us for 16 blocks x 128 tokens (6 KB); end to end (ipc PUB → relay → tcp SUB) the
relay carries 12,000-19,000 small batches a second against 30,000-46,000 for the byte-level
XSUB → XPUB proxy it replaced, i.e. ~50-80 us of one core per batch, mostly pyzmq's receive and send
in Python. An engine publishes at most one batch per step, a few hundred a second: under 3 % of one
core of the worker process (it is not the engine's), so no faster path is warranted.

Started by :func:`tandem.worker.engine.build_engine` before the engine, closed at shutdown.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import zmq

logger = logging.getLogger(__name__)

#: As vLLM's publisher: a subscriber that lags is dropped from, not waited for.
HWM_MESSAGES = 100_000
WILDCARD_HOSTS = ("", "0.0.0.0", "*", "::")
#: vLLM's replay end marker: sequence number -1, 8 bytes signed big-endian.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: A replay client's DEALER to the engine is closed after this long without a request or an answer
#: (a router's catch-ups back off to at most 32 s, so a following router keeps its own).
REPLAY_IDLE_S = 120.0
#: At most this many replay clients at once (a router replica is one; each costs a socket).
MAX_REPLAY_CLIENTS = 64
#: Messages handled from one socket before the others get a turn (a long replay does not hold up
#: the live feed).
_BURST = 256
_POLL_MS = 100


class KVEventRedactError(ValueError):
    """A payload that is not a KV event batch of vLLM's schema (it is dropped, not forwarded)."""


@dataclass(frozen=True)
class KVEventEndpoints:
    """Where the engine publishes and replays (private ipc) and where the relay serves both (tcp)."""

    engine_publish: str
    engine_replay: str
    public_publish: str
    public_replay: str


def plan_endpoints(host: str, port: int, replay_port: int, *, run_dir: str | None = None) -> KVEventEndpoints:
    """The engine's private ipc endpoints and the relay's public ones on ``host`` (all interfaces
    when it is a wildcard)."""
    folder = run_dir or tempfile.gettempdir()
    pid = os.getpid()
    public_host = "*" if host in ("", "*") else _uri_host(host)
    return KVEventEndpoints(
        engine_publish=f"ipc://{os.path.join(folder, f'tandem-kv-events-{port}-{pid}.sock')}",
        engine_replay=f"ipc://{os.path.join(folder, f'tandem-kv-replay-{replay_port}-{pid}.sock')}",
        public_publish=f"tcp://{public_host}:{port}",
        public_replay=f"tcp://{public_host}:{replay_port}",
    )


def _uri_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class BatchRedactor:
    """Called with a payload (a msgpack ``KVEventBatch``), returns it with every ``BlockStored``'s
    token ids zeroed (same count) and its request fields dropped; raises :class:`KVEventRedactError`
    when it is not a batch. The relay's thread owns one (vLLM's decoder and encoder, built once)."""

    def __init__(self) -> None:
        import msgspec
        from vllm.distributed import kv_events as vkv  # the worker's own engine: same schema, same version

        self._decoder: Any = msgspec.msgpack.Decoder(vkv.KVEventBatch)
        self._encoder: Any = msgspec.msgpack.Encoder()
        self._decode_error: Any = msgspec.DecodeError
        self._stored: Any = vkv.BlockStored

    def __call__(self, payload: bytes) -> bytes:
        try:
            batch = self._decoder.decode(payload)
        except self._decode_error as exc:
            raise KVEventRedactError(str(exc)) from exc
        stored = self._stored
        batch.events = [self._redact(e) if isinstance(e, stored) else e for e in batch.events]
        out: bytes = self._encoder.encode(batch)
        return out

    def _redact(self, event: Any) -> Any:
        # An allow-list: a field vLLM adds later stays out until someone decides it is not request data.
        return self._stored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=[0] * len(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            locality=event.locality,
            ownership=event.ownership,
        )


@dataclass
class RelayStats:
    #: Live batches published, redacted.
    num_batches: int = 0
    #: Replay requests forwarded to the engine and batches answered, redacted.
    num_replay_requests: int = 0
    num_replayed_batches: int = 0
    #: Messages dropped: malformed frames, or a payload that is not a batch.
    num_dropped: int = 0


@dataclass
class _ReplayClient:
    client_id: bytes
    dealer: Any  # zmq.Socket connected to the engine's replay ROUTER
    active_s: float


class KVEventRelay:
    """The engine's ipc feed and replay socket, redacted, on :class:`KVEventEndpoints`' tcp endpoints."""

    def __init__(self, endpoints: KVEventEndpoints) -> None:
        self.endpoints = endpoints
        self.stats = RelayStats()
        self._redact = BatchRedactor()
        self._ctx = zmq.Context()
        self._sub = self._socket(zmq.SUB)
        self._pub = self._socket(zmq.PUB)
        self._replay = self._socket(zmq.ROUTER)
        # Binding first: a taken port fails the worker's start, not a thread later.
        for sock, endpoint in ((self._pub, endpoints.public_publish), (self._replay, endpoints.public_replay)):
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoints.engine_publish)  # the engine binds it when it starts; ZMQ reconnects
        self._clients: OrderedDict[bytes, _ReplayClient] = OrderedDict()
        self._by_dealer: dict[Any, _ReplayClient] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._replay, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)

    def _socket(self, kind: int) -> Any:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
        sock.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    @property
    def num_replay_clients(self) -> int:
        return len(self._clients)

    def start(self) -> None:
        self._thread.start()
        logger.info(
            "kv events relayed",
            extra={"endpoint": self.endpoints.public_publish, "replay_endpoint": self.endpoints.public_replay},
        )

    def _run(self) -> None:
        next_expiry_s = 0.0
        try:
            while not self._stop.is_set():
                ready = dict(self._poller.poll(_POLL_MS))
                if self._sub in ready:
                    self._relay_live()
                if self._replay in ready:
                    self._forward_requests()
                for sock in ready:
                    client = self._by_dealer.get(sock)
                    if client is not None:
                        self._relay_answers(client)
                now_s = time.monotonic()
                if now_s >= next_expiry_s:
                    self._expire(now_s)
                    next_expiry_s = now_s + 1.0
        except Exception:
            logger.exception("kv event relay stopped")
        finally:
            for client in list(self._clients.values()):
                self._drop_client(client)
            for sock in (self._sub, self._pub, self._replay):
                sock.close(linger=0)

    def _recv(self, sock: Any) -> list[bytes] | None:
        try:
            frames: list[bytes] = sock.recv_multipart(zmq.NOBLOCK)
            return frames
        except zmq.Again:
            return None

    def _redacted(self, payload: bytes) -> bytes | None:
        try:
            return self._redact(payload)
        except Exception as exc:  # not a batch, or a vLLM whose BlockStored changed: drop, keep relaying
            self.stats.num_dropped += 1
            if self.stats.num_dropped % 1_000 == 1:
                logger.warning(
                    "kv event payload dropped", extra={"num_dropped": self.stats.num_dropped, "error": repr(exc)}
                )
            return None

    def _relay_live(self) -> None:
        for _ in range(_BURST):
            frames = self._recv(self._sub)
            if frames is None:
                return
            if len(frames) != 3:
                self.stats.num_dropped += 1
                continue
            payload = self._redacted(frames[2])
            if payload is None:
                continue
            # A PUB never blocks: a subscriber past its high-water mark loses the message (and replays it).
            self._pub.send_multipart((frames[0], frames[1], payload))
            self.stats.num_batches += 1

    def _forward_requests(self) -> None:
        for _ in range(_BURST):
            frames = self._recv(self._replay)
            if frames is None:
                return
            # (client id, b"", start seq) as vLLM's ROUTER reads it
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.stats.num_dropped += 1
                continue
            client = self._client(frames[0])
            try:
                client.dealer.send_multipart((b"", frames[2]), zmq.NOBLOCK)
                self.stats.num_replay_requests += 1
            except zmq.Again:
                self.stats.num_dropped += 1  # unanswered: the client times out and asks again

    def _client(self, client_id: bytes) -> _ReplayClient:
        client = self._clients.get(client_id)
        if client is None:
            while len(self._clients) >= MAX_REPLAY_CLIENTS:
                self._drop_client(next(iter(self._clients.values())))
            dealer = self._socket(zmq.DEALER)
            dealer.connect(self.endpoints.engine_replay)
            client = _ReplayClient(client_id, dealer, time.monotonic())
            self._clients[client_id] = client
            self._by_dealer[dealer] = client
            self._poller.register(dealer, zmq.POLLIN)
        client.active_s = time.monotonic()
        self._clients.move_to_end(client_id)
        return client

    def _relay_answers(self, client: _ReplayClient) -> None:
        client.active_s = time.monotonic()
        for _ in range(_BURST):
            frames = self._recv(client.dealer)
            if frames is None:
                return
            # (b"", topic, seq, payload); the end marker (b"", b"", END_SEQ, b"")
            if len(frames) != 4 or frames[0] != b"":
                self.stats.num_dropped += 1
                continue
            if frames[2] == END_SEQ:
                answer = frames
            else:
                payload = self._redacted(frames[3])
                if payload is None:
                    continue
                answer = [b"", frames[1], frames[2], payload]
                self.stats.num_replayed_batches += 1
            # A ROUTER drops what it cannot route or queue, as vLLM's does: the client asks again.
            self._replay.send_multipart((client.client_id, *answer), zmq.NOBLOCK)

    def _expire(self, now_s: float) -> None:
        for client in [c for c in self._clients.values() if now_s - c.active_s > REPLAY_IDLE_S]:
            self._drop_client(client)

    def _drop_client(self, client: _ReplayClient) -> None:
        self._poller.unregister(client.dealer)
        del self._by_dealer[client.dealer]
        del self._clients[client.client_id]
        client.dealer.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        else:
            for sock in (self._sub, self._pub, self._replay):
                sock.close(linger=0)
        self._ctx.term()
