"""Follows every registered worker's KV-event publisher into the :class:`KVIndex`.

:class:`tandem.router.scheduler.Scheduler` calls :meth:`KVEventSubscriber.sync`
with the registry's worker list whenever it changes; the subscriber starts one
task per worker that has a ``kv_events_endpoint`` and stops the tasks (and
drops the index entries) of workers that left. Each task:

1. connects a ZMQ SUB socket to the worker's publisher and a DEALER to its
   replay socket;
2. asks the replay socket for every batch the publisher still buffers (from
   sequence 0), so a new or restarted router replica rebuilds the worker's
   blocks instead of waiting for them to be stored again;
3. applies live batches in sequence order; a gap (a dropped message) triggers
   a replay from the first missing sequence number;
4. catches up: once ``catch_up_interval_s`` has passed without a live batch or
   a replay, it asks for the batches after the last one it applied, so a batch
   lost at the end of a burst (no later message reveals the gap) is repaired
   too. An up-to-date publisher answers with its end marker alone, and a busy
   worker is never asked (its next batch reveals any gap). An idle worker is
   asked less and less often (the wait doubles after each catch-up that found
   nothing, up to 16 x the interval, and is back to the interval after its next
   batch): a batch lost after a long silence is repaired within that longest wait.
   Each wait is shortened by a random 0-25 %: workers whose batches arrived
   together (a burst through the fleet, a router that stalled) would otherwise
   be asked together, and keep being asked together as their waits double (the
   fleet benchmark saw waves of dozens of catch-ups within 2 ms, and the
   Schedules that arrived meanwhile waited behind them).

Replies are applied in sequence order as well: vLLM's replay ROUTER drops what
exceeds its high-water mark (1,000 messages) while it streams a large buffer,
often the end marker with it, so at a gap inside a reply, or when a reply
stops short (``STREAM_SILENCE_S``), the task reconnects and asks again from the
first missing batch (each round gets the first thousand or more). Batches the
publisher no longer buffers, and those lost while its replay socket does not
answer, are skipped and counted (``num_unrepaired_batches``): their blocks
stay unknown until stored again.

Scale: each subscriber has a ZMQ context of its own with ``MAX_SOCKETS``
raised (the shared default context allows 1,023 sockets, and a router holds
two per worker), created on first use and terminated by :meth:`aclose`.

A worker that restarted registers with a new ``started_unix_s``: its entries
are dropped and followed afresh. Wire format: :mod:`tandem.common.kv_events`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tandem.common.kv_events import END_SEQ, KVEventDecodeError, decode_batch, decode_seq, encode_seq
from tandem.common.registry import WorkerRecord
from tandem.router.kv_index import KVIndex

logger = logging.getLogger(__name__)

#: Upper bound on the sockets of one subscriber's ZMQ context (two per followed worker, clipped to
#: libzmq's own limit). ZMQ's default, 1,023, stops a router at ~500 workers with "Too many open
#: files"; raising it costs nothing until sockets exist. Each socket also takes about two file
#: descriptors (its mailbox and its TCP connection), so the process's open-file limit must allow
#: ~4 per worker.
MAX_SOCKETS = 65_536
#: Silence that ends a reply already streaming without its end marker: vLLM sends a whole reply
#: from one loop, so a pause this long means the replay socket dropped the rest (ask again).
STREAM_SILENCE_S = 0.5
#: Longest a worker's task applies batches before it lets the loop run other callbacks. pyzmq
#: completes a receive at once when a message is already queued, so without this a burst (a busy
#: publisher, a replay of a thousand batches) runs as one callback of tens of milliseconds and every
#: schedule arriving meanwhile waits behind it.
APPLY_SLICE_S = 0.0005


@dataclass(frozen=True)
class _Source:
    worker_id: str
    endpoint: str
    replay_endpoint: str
    started_unix_s: float


@dataclass
class SubscriberStats:
    #: Batches applied (live or replayed) and the events in them.
    num_batches: int = 0
    num_events: int = 0
    #: Replay requests sent: one when a worker is first followed, one per gap, the catch-ups, and
    #: a retry whenever the replay socket dropped part of its answer.
    num_replays: int = 0
    #: Of those, periodic catch-ups (step 4 in the module docstring).
    num_catch_ups: int = 0
    #: Batches applied from a replay other than a worker's first: lost on the live stream, repaired.
    num_recovered_batches: int = 0
    #: Lost batches given up on: the publisher no longer buffered them, or its replay socket did not
    #: answer (their blocks stay unknown until stored again).
    num_unrepaired_batches: int = 0
    num_decode_errors: int = 0
    #: Live batches whose sequence number skipped ahead of the last one applied.
    num_gaps: int = 0
    #: Live messages discarded by ``drop_fraction`` (fault injection; 0 in production).
    num_dropped: int = 0


#: An idle worker's catch-ups back off to at most this many times ``catch_up_interval_s``: at 1,000
#: idle workers, asking each every 2 s cost 15-18 % of a core (~0.3 ms per ask).
_MAX_CATCH_UP_BACKOFF = 16
#: Each catch-up wait is its nominal length times a factor drawn from [1 - this, 1] (step 4 in the
#: module docstring).
_CATCH_UP_JITTER = 0.25


class _Follower:
    """One worker's replay socket and progress; owned by that worker's task."""

    def __init__(self, source: _Source) -> None:
        self.source = source
        #: Sequence number of the last batch applied (-1: none yet).
        self.last_seq = -1
        #: Loop time of the last live batch or replay: a catch-up is due ``catch_up_interval_s`` later.
        self.last_heard_s = 0.0
        #: After a replay timed out, gaps are skipped without asking until then (catch-ups still ask).
        self.replay_down_until_s = 0.0
        #: The wait before the next catch-up: the subscriber's interval after a live batch, doubled after
        #: each catch-up that found nothing, up to 16 times it.
        self.catch_up_wait_s = 0.0
        #: The factor in [1 - _CATCH_UP_JITTER, 1] applied to the current wait.
        self.catch_up_jitter = 1.0
        self.dealer: Any = None
        #: ``perf_counter`` time by which this task next yields to the loop (see ``APPLY_SLICE_S``).
        self.slice_end_s = 0.0
        #: What the task awaits between batches: set by the live receive completing or by the
        #: catch-up's timer (cheaper than ``asyncio.wait`` with a timeout, which builds a waiter, a
        #: closure and a timer and adds and removes callbacks on every wait).
        self.wake: asyncio.Future[None] | None = None

    def wake_up(self, *_: object) -> None:
        wake = self.wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def slice_spent(self) -> bool:
        """Whether this task has applied batches for ``APPLY_SLICE_S`` in a row and should yield to the
        loop now (the caller then yields and calls :meth:`start_slice`)."""
        now_s = time.perf_counter()
        if now_s < self.slice_end_s:
            return False
        if not self.slice_end_s:
            self.slice_end_s = now_s + APPLY_SLICE_S
            return False
        return True

    def start_slice(self) -> None:
        self.slice_end_s = time.perf_counter() + APPLY_SLICE_S

    async def pace(self) -> None:
        """Yield to the loop once this task has applied batches for ``APPLY_SLICE_S`` in a row."""
        if self.slice_spent():
            await asyncio.sleep(0)
            self.start_slice()

    def close_dealer(self) -> None:
        """Forget the replay connection, and with it whatever is left of an answer."""
        if self.dealer is not None:
            self.dealer.close(linger=0)
            self.dealer = None


class KVEventSubscriber:
    def __init__(
        self,
        index: KVIndex,
        *,
        replay_timeout_s: float = 2.0,
        catch_up_interval_s: float = 2.0,
        drop_fraction: float = 0.0,
        drop_seed: int = 0,
    ) -> None:
        """``replay_timeout_s``: the longest silence while waiting for a replay's next message.
        ``catch_up_interval_s``: an idle worker is asked for what it published since the last batch
        applied this long after its last live batch or replay (step 4 in the module docstring).

        ``drop_fraction`` is a fault-injection knob for tests and benchmarks only: that fraction of
        live PUB messages is discarded on receipt, as if the network had lost them (counted in
        ``stats.num_dropped``), so that the repair paths run. The decision takes one draw of
        ``random.Random(drop_seed)`` per live message, in the order they arrive."""
        if not 0.0 <= drop_fraction < 1.0:
            raise ValueError("drop_fraction must be in [0, 1)")
        if catch_up_interval_s <= 0 or replay_timeout_s <= 0:
            raise ValueError("catch_up_interval_s and replay_timeout_s must be positive")
        self._index = index
        self._ctx: Any = None  # zmq.asyncio.Context, created by the first follow
        self._replay_timeout_s = replay_timeout_s
        self._catch_up_interval_s = catch_up_interval_s
        self._drop_fraction = drop_fraction
        self._drop_rng = random.Random(drop_seed)
        # Spreads the workers' catch-ups over the interval (a fleet followed at once would otherwise
        # ask all together); separate from the drop draws so that those stay reproducible.
        self._phase_rng = random.Random()
        self._tasks: dict[str, tuple[_Source, asyncio.Task[None]]] = {}
        self.stats = SubscriberStats()

    def _jitter(self) -> float:
        return 1.0 - _CATCH_UP_JITTER * self._phase_rng.random()

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
        """Stop following every worker and terminate this subscriber's ZMQ context (a later
        :meth:`sync` starts a new one)."""
        for _, task in self._tasks.values():
            task.cancel()
        for _, task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _context(self) -> Any:
        if self._ctx is None:
            import zmq
            import zmq.asyncio  # the router's own dependency; not needed by the pure index

            ctx = zmq.asyncio.Context()
            # Before the first socket: libzmq sizes its socket table then.
            ctx.set(zmq.MAX_SOCKETS, min(MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT)))
            self._ctx = ctx
        return self._ctx

    # -- one worker --------------------------------------------------------------

    async def _follow(self, source: _Source) -> None:
        import zmq

        sub = self._context().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(source.endpoint)
        logger.info("following KV events", extra={"worker_id": source.worker_id, "endpoint": source.endpoint})
        follower = _Follower(source)
        loop = asyncio.get_running_loop()
        live: asyncio.Future[list[bytes]] | None = None
        try:
            await self._replay(follower, first=True)
            follower.catch_up_wait_s = self._catch_up_interval_s
            follower.last_heard_s -= self._phase_rng.random() * self._catch_up_interval_s
            while True:
                if live is None:
                    live = sub.recv_multipart()
                    live.add_done_callback(follower.wake_up)
                if source.replay_endpoint and not live.done():
                    # The receive stays pending across catch-ups: re-arming it for every wait would
                    # make pyzmq register and unregister the socket with the loop each time.
                    due_s = follower.last_heard_s + follower.catch_up_wait_s * follower.catch_up_jitter
                    if due_s > loop.time():
                        follower.wake = loop.create_future()
                        timer = loop.call_at(due_s, follower.wake_up)
                        try:
                            await follower.wake
                        finally:
                            timer.cancel()
                            follower.wake = None
                    if not live.done():
                        self.stats.num_catch_ups += 1
                        last_seq = follower.last_seq
                        await self._replay(follower)
                        if follower.last_seq == last_seq:  # nothing was lost: ask an idle worker less often
                            follower.catch_up_wait_s = min(
                                2 * follower.catch_up_wait_s, _MAX_CATCH_UP_BACKOFF * self._catch_up_interval_s
                            )
                        follower.catch_up_jitter = self._jitter()
                        continue
                frames = await live
                live = None
                gap_seq = self._receive_live(follower, frames)
                if gap_seq is not None:
                    await self._repair_gap(follower, gap_seq, frames)
                if follower.slice_spent():
                    await asyncio.sleep(0)
                    follower.start_slice()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV event subscription failed", extra={"worker_id": source.worker_id})
        finally:
            if live is not None:
                live.cancel()
            sub.close(linger=0)
            follower.close_dealer()

    def _receive_live(self, follower: _Follower, frames: list[bytes]) -> int | None:
        """Apply a live batch that follows the last one applied (no await: the usual case); returns its
        seq when batches are missing before it (then :meth:`_repair_gap`), else None."""
        if self._drop_fraction and self._drop_rng.random() < self._drop_fraction:
            self.stats.num_dropped += 1
            return None
        if len(frames) != 3:
            self.stats.num_decode_errors += 1
            return None
        seq = decode_seq(frames[1])
        if seq <= follower.last_seq:
            return None  # already applied from a replay
        loop = asyncio.get_running_loop()
        follower.last_heard_s = loop.time()
        follower.catch_up_wait_s = self._catch_up_interval_s
        follower.catch_up_jitter = self._jitter()
        if seq > follower.last_seq + 1:
            self.stats.num_gaps += 1
            return seq
        self._apply(follower, seq, frames[2])
        return None

    async def _repair_gap(self, follower: _Follower, seq: int, frames: list[bytes]) -> None:
        """A live batch ``seq`` came with batches missing before it: replay them, then apply it."""
        loop = asyncio.get_running_loop()
        if follower.source.replay_endpoint and loop.time() >= follower.replay_down_until_s:
            await self._replay(follower)
            if seq <= follower.last_seq:
                return
        # Not replayed (no longer buffered, or the replay socket does not answer): skip the missing
        # batches rather than stall the live stream behind them.
        self.stats.num_unrepaired_batches += seq - follower.last_seq - 1
        self._apply(follower, seq, frames[2])

    async def _replay(self, follower: _Follower, *, first: bool = False) -> None:
        """Apply the publisher's buffered batches after ``follower.last_seq`` (no-op without a replay
        endpoint); ``first``: the rebuild when a worker is first followed."""
        if not follower.source.replay_endpoint:
            return
        loop = asyncio.get_running_loop()
        try:
            while (answered := await self._replay_round(follower, first=first)) is None:
                pass  # the replay socket dropped part of its answer: ask again from the first missing batch
            if not answered:
                follower.replay_down_until_s = loop.time() + self._catch_up_interval_s
        finally:
            follower.last_heard_s = loop.time()

    async def _replay_round(self, follower: _Follower, *, first: bool) -> bool | None:
        """One replay request: True when read to the end marker, False when the publisher did not
        answer, None when its answer skipped batches or stopped short (ask again from there)."""
        import zmq

        self.stats.num_replays += 1
        if follower.dealer is None:
            follower.dealer = self._context().socket(zmq.DEALER)
            follower.dealer.setsockopt(zmq.LINGER, 0)
            follower.dealer.connect(follower.source.replay_endpoint)
        dealer = follower.dealer
        start_seq = follower.last_seq + 1
        await dealer.send_multipart((b"", encode_seq(start_seq)))
        dealer.setsockopt(zmq.RCVTIMEO, int(self._replay_timeout_s * 1000))
        streaming = False
        while True:
            try:
                frames = await dealer.recv_multipart()
            except zmq.Again:
                follower.close_dealer()  # a late answer must not be read as the next request's
                if follower.last_seq >= start_seq:
                    return None  # the answer stopped short: its tail (and end marker) was dropped
                logger.warning("KV event replay timed out", extra={"worker_id": follower.source.worker_id})
                return False
            if not streaming:
                streaming = True
                dealer.setsockopt(zmq.RCVTIMEO, int(min(self._replay_timeout_s, STREAM_SILENCE_S) * 1000))
            # (b"", topic, seq, payload); the end marker is (b"", b"", END_SEQ, b"")
            if len(frames) != 4:
                self.stats.num_decode_errors += 1
                continue
            if frames[2] == END_SEQ:
                return True
            seq = decode_seq(frames[2])
            if seq <= follower.last_seq:
                continue
            if seq > follower.last_seq + 1:
                if follower.last_seq + 1 != start_seq:
                    follower.close_dealer()
                    return None
                # The answer starts past what was asked: the publisher's buffer no longer reaches back
                # (normal for a first replay from a long-running publisher; a loss otherwise).
                if not first:
                    self.stats.num_unrepaired_batches += seq - start_seq
                    logger.warning(
                        "lost KV event batches no longer buffered by the publisher",
                        extra={"worker_id": follower.source.worker_id, "from_seq": start_seq, "to_seq": seq - 1},
                    )
            if not first:
                self.stats.num_recovered_batches += 1
            self._apply(follower, seq, frames[3])
            await follower.pace()

    def _apply(self, follower: _Follower, seq: int, payload: bytes) -> None:
        follower.last_seq = seq
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError:
            self.stats.num_decode_errors += 1
            return
        self.stats.num_batches += 1
        self.stats.num_events += len(batch.events)
        worker_id = follower.source.worker_id
        for event in batch.events:
            self._index.apply(worker_id, event)
