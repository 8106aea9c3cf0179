"""One worker's KV events into the index: its sockets, its live stream, its catch-ups and replays.

:class:`tandem.router.kv_subscriber.KVEventSubscriber` makes a :class:`Follower` for each worker it
follows and closes it when the worker leaves; everything the followers of one subscriber share (the
index, the stats, the settings, the ZMQ context) is its :class:`Following`. A follower applies
each decoded batch with :meth:`tandem.router.kv_index.KVIndex.apply`. For each worker it:

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
stops short (``STREAM_SILENCE_S``), it reconnects and asks again from the
first missing batch (each round gets the first thousand or more). Batches the
publisher no longer buffers, and those lost while its replay socket does not
answer, are skipped and counted (``num_unrepaired_batches``): their blocks
stay unknown until stored again.

**No task, no future per message.** Each worker is a :class:`_Follower` driven by
callbacks: its two sockets are plain ZMQ sockets whose file descriptors stay
registered with the event loop (``add_reader``), a readable descriptor drains
what is queued with non-blocking receives, and the catch-up and the replay's
silence are timers. Before (2026-12-05, the fleet benchmark: 1,000 SIMULATED
workers, ~255 live batches and ~180 catch-ups a second), a task per worker
awaiting pyzmq's asyncio sockets cost ~2.3 s of the router's event loop in 33 s,
~160 us per batch or catch-up against ~25 us to apply a batch to the index: a
future, a task step and a registration of the socket with the loop for every
receive, and a waiter, a closure and a timer for every wait. While a replay
runs, the live stream is not read (its messages queue in the SUB socket and
are applied after it, in order); a batch, a reply or a burst of either is
applied for at most ``APPLY_SLICE_S`` before the follower lets the loop run
other callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.common.kv_events import END_SEQ, KVEventDecodeError, decode_batch, decode_seq, encode_seq
from tandem.router.kv_index import KVIndex

logger = logging.getLogger(__name__)

#: Silence that ends a reply already streaming without its end marker: vLLM sends a whole reply
#: from one loop, so a pause this long means the replay socket dropped the rest (ask again).
STREAM_SILENCE_S = 0.5
#: Longest a worker's task applies batches before it lets the loop run other callbacks. pyzmq
#: completes a receive at once when a message is already queued, so without this a burst (a busy
#: publisher, a replay of a thousand batches) runs as one callback of tens of milliseconds and every
#: schedule arriving meanwhile waits behind it.
APPLY_SLICE_S = 0.0005


@dataclass(frozen=True)
class Source:
    """Where a worker publishes: a change (a restart) means following it afresh."""

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
#: Each catch-up wait is its nominal length times a factor drawn from [1 - this, 1] (step 4 above).
_CATCH_UP_JITTER = 0.25


@dataclass
class Following:
    """What the followers of one subscriber share: where batches go, what is counted, the settings
    (see :class:`tandem.router.kv_subscriber.KVEventSubscriber`) and the ZMQ context."""

    index: KVIndex
    #: The ZMQ context, created on first use by the subscriber.
    context: Callable[[], Any]
    replay_timeout_s: float
    catch_up_interval_s: float
    drop_fraction: float
    #: One draw per live message, in the order they arrive (``drop_fraction``).
    drop_rng: random.Random
    #: Spreads the workers' catch-ups over the interval (a fleet followed at once would otherwise
    #: ask all together); separate from the drop draws so that those stay reproducible.
    phase_rng: random.Random = field(default_factory=random.Random)
    stats: SubscriberStats = field(default_factory=SubscriberStats)

    def jitter(self) -> float:
        """A catch-up wait's factor, drawn from [1 - _CATCH_UP_JITTER, 1]."""
        return 1.0 - _CATCH_UP_JITTER * self.phase_rng.random()


#: Why a replay is running (what its end does next).
_FIRST, _CATCH_UP, _GAP = "first", "catch-up", "gap"
#: Where a replay round stands: its answer goes on; it was read to the end marker; it skipped batches
#: or stopped short (ask again from the first missing); the replay socket did not answer.
_GO_ON, _ANSWERED, _AGAIN, _UNANSWERED = "go on", "answered", "again", "unanswered"


@dataclass
class _Round:
    """One replay request and its answer so far."""

    #: The first seq asked for.
    start_seq: int
    #: The first message of the answer arrived (the silence allowed shrinks to ``STREAM_SILENCE_S``).
    streaming: bool = False
    #: ``loop.time()`` of the request or of the answer's last message.
    heard_s: float = 0.0


class Follower:
    """One worker's sockets, progress and timers; see the module docstring."""

    def __init__(self, following: Following, source: Source) -> None:
        import zmq

        self._zmq = zmq
        self._following = following
        self._stats = following.stats
        self._loop = asyncio.get_running_loop()
        self.source = source
        #: Sequence number of the last batch applied (-1: none yet).
        self.last_seq = -1
        #: Loop time of the last live batch or replay: a catch-up is due ``catch_up_wait_s`` later.
        self.last_heard_s = 0.0
        #: After a replay timed out, gaps are skipped without asking until then (catch-ups still ask).
        self.replay_down_until_s = 0.0
        #: The wait before the next catch-up: the subscriber's interval after a live batch, doubled after
        #: each catch-up that found nothing, up to 16 times it.
        self.catch_up_wait_s = 0.0
        #: The factor in [1 - _CATCH_UP_JITTER, 1] applied to the current wait.
        self.catch_up_jitter = 1.0
        self.closed = False
        #: Why the replay in progress runs (None: none; the live stream is read only then).
        self._replaying: str | None = None
        self._round: _Round | None = None
        #: A catch-up's last seq before it asked (did it find anything?); a gap's live batch, applied after.
        self._seq_before_catch_up = -1
        self._held_batch: tuple[int, bytes] | None = None
        self._round_timer: asyncio.TimerHandle | None = None
        self._catch_up_timer: asyncio.TimerHandle | None = None
        self._sub: Any = following.context().socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(source.endpoint)
        #: A call of _read_live / _read_replay is scheduled: the descriptor's callback leaves it to that one
        #: (else every readable look would start one more chain of slices).
        self._live_soon = False
        self._replay_soon = False
        self._loop.add_reader(self._sub.FD, self._guarded, self._on_live_readable)
        self._dealer: Any = None
        logger.info("following KV events", extra={"worker_id": source.worker_id, "endpoint": source.endpoint})
        # The live stream waits for the rebuild (its messages queue meanwhile); the request goes out
        # from the loop, where a failure is logged, not raised into the caller of sync().
        self._replaying = _FIRST
        self._soon(lambda: self._start_replay(_FIRST))

    @property
    def replaying(self) -> bool:
        """A replay runs: the live stream waits."""
        return self._replaying is not None

    # -- plumbing ------------------------------------------------------------------------------

    def _guarded(self, callback: Callable[[], None]) -> None:
        """Run one of this follower's callbacks; a failure stops following the worker (logged)."""
        if self.closed:
            return
        try:
            callback()
        except Exception:
            logger.exception("KV event subscription failed", extra={"worker_id": self.source.worker_id})
            self.close()

    def _soon(self, callback: Callable[[], None]) -> None:
        self._loop.call_soon(self._guarded, callback)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for timer in (self._round_timer, self._catch_up_timer):
            if timer is not None:
                timer.cancel()
        self._loop.remove_reader(self._sub.FD)
        self._sub.close(linger=0)
        self._close_dealer()

    def _close_dealer(self) -> None:
        """Forget the replay connection, and with it whatever is left of an answer."""
        if self._dealer is not None:
            self._loop.remove_reader(self._dealer.FD)
            self._dealer.close(linger=0)
            self._dealer = None

    def _receive(self, socket: Any) -> list[bytes] | None:
        """The next message queued on ``socket``, or None. ZMQ's descriptor is edge-triggered: once a
        receive finds nothing, the events are read, which re-arms it; a message that arrived in
        between shows in them (the descriptor will not signal it) and is received."""
        zmq = self._zmq
        while True:
            try:
                frames: list[bytes] = socket.recv_multipart(zmq.NOBLOCK)
                return frames
            except zmq.Again:
                if not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return None

    # -- the live stream -----------------------------------------------------------------------

    def _on_live_readable(self) -> None:
        if self._replaying is not None:
            # The messages wait for the replay's end; reading the events resets the descriptor, which
            # the loop would otherwise find readable on every turn until then.
            self._sub.getsockopt(self._zmq.EVENTS)
            return
        if not self._live_soon:
            self._read_live()

    def _read_live_soon(self) -> None:
        if not self._live_soon:
            self._live_soon = True
            self._soon(self._read_live)

    def _read_live(self) -> None:
        self._live_soon = False
        slice_end_s = time.perf_counter() + APPLY_SLICE_S
        while self._replaying is None and not self.closed:
            frames = self._receive(self._sub)
            if frames is None:
                return
            self._receive_live(frames)
            if time.perf_counter() >= slice_end_s:
                self._read_live_soon()  # the rest after the callbacks waiting meanwhile
                return

    def _receive_live(self, frames: list[bytes]) -> None:
        following, stats = self._following, self._stats
        if following.drop_fraction and following.drop_rng.random() < following.drop_fraction:
            stats.num_dropped += 1
            return
        if len(frames) != 3:
            stats.num_decode_errors += 1
            return
        seq = decode_seq(frames[1])
        if seq <= self.last_seq:
            return  # already applied from a replay
        now_s = self._loop.time()
        self.last_heard_s = now_s
        self.catch_up_wait_s = following.catch_up_interval_s
        self.catch_up_jitter = following.jitter()
        if seq > self.last_seq + 1:
            stats.num_gaps += 1
            if self.source.replay_endpoint and now_s >= self.replay_down_until_s:
                self._held_batch = (seq, frames[2])
                self._start_replay(_GAP)
                return
            # Not replayed (the replay socket does not answer): skip the missing batches rather than
            # stall the live stream behind them.
            stats.num_unrepaired_batches += seq - self.last_seq - 1
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError:
            self._stats.num_decode_errors += 1
            return
        self._stats.num_batches += 1
        self._stats.num_events += len(batch.events)
        worker_id, index = self.source.worker_id, self._following.index
        for event in batch.events:
            index.apply(worker_id, event)

    # -- catch-ups -----------------------------------------------------------------------------

    def _arm_catch_up(self) -> None:
        if self.source.replay_endpoint and not self.closed:
            due_s = self.last_heard_s + self.catch_up_wait_s * self.catch_up_jitter
            self._catch_up_timer = self._loop.call_at(due_s, self._guarded, self._catch_up_due)

    def _catch_up_due(self) -> None:
        self._catch_up_timer = None
        if self._sub.getsockopt(self._zmq.EVENTS) & self._zmq.POLLIN and self._replaying is None:
            self._read_live()  # live batches are waiting: they come first, and move the catch-up
        if self.replaying:
            return  # the replay's end arms the next one
        due_s = self.last_heard_s + self.catch_up_wait_s * self.catch_up_jitter
        if self._loop.time() < due_s:  # a live batch (or a replay) came since this was armed
            self._catch_up_timer = self._loop.call_at(due_s, self._guarded, self._catch_up_due)
            return
        self._stats.num_catch_ups += 1
        self._seq_before_catch_up = self.last_seq
        self._start_replay(_CATCH_UP)

    # -- replays -------------------------------------------------------------------------------

    def _start_replay(self, why: str) -> None:
        """Ask the replay socket for the batches after ``last_seq``; the live stream waits meanwhile."""
        if not self.source.replay_endpoint:
            self._replay_ended(why, answered=True)
            return
        self._replaying = why
        self._ask()

    def _ask(self) -> None:
        zmq = self._zmq
        self._stats.num_replays += 1
        if self._dealer is None:
            self._dealer = self._following.context().socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.source.replay_endpoint)
            self._loop.add_reader(self._dealer.FD, self._guarded, self._on_replay_readable)
        self._round = _Round(self.last_seq + 1, heard_s=self._loop.time())
        try:
            self._dealer.send_multipart((b"", encode_seq(self._round.start_seq)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not sent (nowhere to queue it): ends as an unanswered request
        self._round_timer = self._loop.call_at(
            self._round.heard_s + self._following.replay_timeout_s, self._guarded, self._round_silent
        )
        self._read_replay_soon()  # a send can consume the descriptor's edge

    def _silence_allowed_s(self, round_: _Round) -> float:
        timeout_s = self._following.replay_timeout_s
        return min(timeout_s, STREAM_SILENCE_S) if round_.streaming else timeout_s

    def _round_silent(self) -> None:
        """The round's timer: the answer is late (or stopped), unless a message came since it was armed."""
        self._round_timer = None
        round_ = self._round
        if round_ is None:
            return
        due_s = round_.heard_s + self._silence_allowed_s(round_)
        if self._loop.time() < due_s:
            self._round_timer = self._loop.call_at(due_s, self._guarded, self._round_silent)
            return
        self._close_dealer()  # a late answer must not be read as the next request's
        if self.last_seq >= round_.start_seq:
            self._round_ended(_AGAIN)  # the answer stopped short: its tail (and end marker) was dropped
            return
        logger.warning("KV event replay timed out", extra={"worker_id": self.source.worker_id})
        self._round_ended(_UNANSWERED)

    def _on_replay_readable(self) -> None:
        if not self._replay_soon:
            self._read_replay()

    def _read_replay_soon(self) -> None:
        if not self._replay_soon:
            self._replay_soon = True
            self._soon(self._read_replay)

    def _read_replay(self) -> None:
        self._replay_soon = False
        if self._dealer is None:
            return
        slice_end_s = time.perf_counter() + APPLY_SLICE_S
        while (round_ := self._round) is not None and self._dealer is not None:
            frames = self._receive(self._dealer)
            if frames is None:
                return
            round_.heard_s = self._loop.time()
            round_.streaming = True
            outcome = self._receive_replayed(round_, frames)
            if outcome is not _GO_ON:
                self._round_ended(outcome)
                return
            if time.perf_counter() >= slice_end_s:
                self._read_replay_soon()
                return
        # No round: whatever comes is an answer nobody waits for any more.
        while self._dealer is not None and self._receive(self._dealer) is not None:
            pass

    def _receive_replayed(self, round_: _Round, frames: list[bytes]) -> str:
        """One message of the answer: ``_GO_ON``, ``_ANSWERED`` (the end marker) or ``_AGAIN`` (it
        skipped batches)."""
        stats = self._stats
        # (b"", topic, seq, payload); the end marker is (b"", b"", END_SEQ, b"")
        if len(frames) != 4:
            stats.num_decode_errors += 1
            return _GO_ON
        if frames[2] == END_SEQ:
            return _ANSWERED
        seq = decode_seq(frames[2])
        if seq <= self.last_seq:
            return _GO_ON
        first = self._replaying == _FIRST
        if seq > self.last_seq + 1:
            if self.last_seq + 1 != round_.start_seq:
                self._close_dealer()
                return _AGAIN
            # The answer starts past what was asked: the publisher's buffer no longer reaches back
            # (normal for a first replay from a long-running publisher; a loss otherwise).
            if not first:
                stats.num_unrepaired_batches += seq - round_.start_seq
                logger.warning(
                    "lost KV event batches no longer buffered by the publisher",
                    extra={"worker_id": self.source.worker_id, "from_seq": round_.start_seq, "to_seq": seq - 1},
                )
        if not first:
            stats.num_recovered_batches += 1
        self._apply(seq, frames[3])
        return _GO_ON

    def _round_ended(self, outcome: str) -> None:
        self._round = None
        if self._round_timer is not None:
            self._round_timer.cancel()
            self._round_timer = None
        why = self._replaying
        assert why is not None
        if outcome == _AGAIN:
            self._ask()  # the replay socket dropped part of its answer: ask again from the first missing
            return
        self._replay_ended(why, answered=outcome == _ANSWERED)

    def _replay_ended(self, why: str, *, answered: bool) -> None:
        following = self._following
        now_s = self._loop.time()
        if not answered:
            self.replay_down_until_s = now_s + following.catch_up_interval_s
        self._replaying = None
        if self.source.replay_endpoint:
            self.last_heard_s = now_s
        if why == _FIRST:
            self.catch_up_wait_s = following.catch_up_interval_s
            self.last_heard_s -= following.phase_rng.random() * following.catch_up_interval_s
        elif why == _CATCH_UP:
            if self.last_seq == self._seq_before_catch_up:  # nothing was lost: ask an idle worker less often
                self.catch_up_wait_s = min(
                    2 * self.catch_up_wait_s, _MAX_CATCH_UP_BACKOFF * following.catch_up_interval_s
                )
            self.catch_up_jitter = following.jitter()
        elif why == _GAP and self._held_batch is not None:
            seq, payload = self._held_batch
            self._held_batch = None
            if seq > self.last_seq:
                # Not replayed (no longer buffered, or the replay socket did not answer): skip the
                # missing batches rather than stall the live stream behind them.
                self._stats.num_unrepaired_batches += seq - self.last_seq - 1
                self._apply(seq, payload)
        if self._catch_up_timer is None:
            self._arm_catch_up()
        self._read_live_soon()  # what queued on the live stream meanwhile
