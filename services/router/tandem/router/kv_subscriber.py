"""Follows every registered worker's KV-event publisher into the :class:`KVIndex`.

:class:`tandem.router.scheduler.Scheduler` calls :meth:`KVEventSubscriber.sync`
with the registry's worker list whenever it changes; the subscriber starts one
task per worker that has a ``kv_events_endpoint`` and stops the tasks (and
drops the index entries) of workers that left. Each task:

1. connects a ZMQ SUB socket to the worker's publisher;
2. asks the replay socket for every batch the publisher still buffers (from
   sequence 0), so a new or restarted router replica rebuilds the worker's
   blocks instead of waiting for them to be stored again;
3. applies live batches in sequence order; a gap (a dropped message) triggers
   a replay from the first missing sequence number.

A worker that restarted registers with a new ``started_unix_s``: its entries
are dropped and followed afresh. Wire format: :mod:`tandem.common.kv_events`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tandem.common.kv_events import END_SEQ, KVEventDecodeError, decode_batch, decode_seq, encode_seq
from tandem.common.registry import WorkerRecord
from tandem.router.kv_index import KVIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    worker_id: str
    endpoint: str
    replay_endpoint: str
    started_unix_s: float


@dataclass
class SubscriberStats:
    num_batches: int = 0
    num_events: int = 0
    num_replays: int = 0
    num_decode_errors: int = 0
    num_gaps: int = 0


class KVEventSubscriber:
    def __init__(self, index: KVIndex, *, replay_timeout_s: float = 2.0) -> None:
        import zmq.asyncio  # the router's own dependency; not needed by the pure index

        self._index = index
        self._ctx = zmq.asyncio.Context.instance()
        self._replay_timeout_s = replay_timeout_s
        self._tasks: dict[str, tuple[_Source, asyncio.Task[None]]] = {}
        self._last_seq: dict[str, int] = {}
        self.stats = SubscriberStats()

    @property
    def index(self) -> KVIndex:
        return self._index

    def sync(self, workers: Iterable[WorkerRecord]) -> None:
        """Follow exactly the workers in ``workers`` that publish KV events."""
        wanted = {
            w.worker_id: _Source(w.worker_id, w.kv_events_endpoint, w.kv_events_replay_endpoint, w.started_unix_s)
            for w in workers
            if w.kv_events_endpoint
        }
        for worker_id in list(self._tasks):
            source, task = self._tasks[worker_id]
            if wanted.get(worker_id) != source:
                task.cancel()
                del self._tasks[worker_id]
                self._last_seq.pop(worker_id, None)
                self._index.remove_worker(worker_id)
                logger.info("stopped following KV events", extra={"worker_id": worker_id})
        loop = asyncio.get_running_loop()
        for worker_id, source in wanted.items():
            if worker_id not in self._tasks:
                self._tasks[worker_id] = (source, loop.create_task(self._follow(source)))

    @property
    def num_following(self) -> int:
        """Workers whose publisher this subscriber follows."""
        return len(self._tasks)

    async def aclose(self) -> None:
        for _, task in self._tasks.values():
            task.cancel()
        for _, task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    # -- one worker --------------------------------------------------------------

    async def _follow(self, source: _Source) -> None:
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(source.endpoint)
        logger.info("following KV events", extra={"worker_id": source.worker_id, "endpoint": source.endpoint})
        try:
            await self._replay(source, 0)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.stats.num_decode_errors += 1
                    continue
                seq = decode_seq(frames[1])
                last = self._last_seq.get(source.worker_id, -1)
                if seq <= last:
                    continue  # already applied from a replay
                if seq > last + 1 and source.replay_endpoint:
                    self.stats.num_gaps += 1
                    await self._replay(source, last + 1)
                    if seq <= self._last_seq.get(source.worker_id, -1):
                        continue
                self._apply(source.worker_id, seq, frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV event subscription failed", extra={"worker_id": source.worker_id})
        finally:
            sub.close(linger=0)

    async def _replay(self, source: _Source, start_seq: int) -> None:
        """Apply the publisher's buffered batches from ``start_seq`` on; no-op without a replay endpoint."""
        if not source.replay_endpoint:
            return
        import zmq

        self.stats.num_replays += 1
        dealer: Any = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(source.replay_endpoint)
        try:
            await dealer.send_multipart((b"", encode_seq(start_seq)))
            while True:
                if not await dealer.poll(self._replay_timeout_s * 1000):
                    logger.warning("KV event replay timed out", extra={"worker_id": source.worker_id})
                    return
                frames = await dealer.recv_multipart()
                # (b"", topic, seq, payload); the end marker is (b"", b"", END_SEQ, b"")
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                seq = decode_seq(frames[2])
                if seq > self._last_seq.get(source.worker_id, -1):
                    self._apply(source.worker_id, seq, frames[3])
        finally:
            dealer.close(linger=0)

    def _apply(self, worker_id: str, seq: int, payload: bytes) -> None:
        self._last_seq[worker_id] = seq
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError:
            self.stats.num_decode_errors += 1
            return
        self.stats.num_batches += 1
        self.stats.num_events += len(batch.events)
        for event in batch.events:
            self._index.apply(worker_id, event)
