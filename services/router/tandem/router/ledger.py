"""What router replicas share, so that they are active-active with one view: every replica's
reservations, waiting requests and the tokens each tenant was served.

The :class:`tandem.router.scheduler.Scheduler` of each replica tells its :class:`Ledger` about
every change as it happens (:meth:`Ledger.reserved`, :meth:`Ledger.released`,
:meth:`Ledger.queued`, :meth:`Ledger.dequeued`: no I/O, they append to an outbox). The ledger:

* **publishes** the outbox on one Redis pub/sub channel as a numbered message ``[replica id,
  seq, events]``: at the end of the event-loop iteration that made the changes (or every
  ``flush_interval_s``, to batch more), as one PUBLISH on a connection of its own, sent by one
  writer task (:class:`tandem.router.pubsub.Publisher`), so the messages leave in seq order;
* **mirrors** every other replica from the same channel: their reservations in a
  :class:`~tandem.router.reservations.ReservationTable` each (so their tokens, young tokens,
  requests in flight and recently placed tokens per worker come out of the same code as this
  replica's own), and their waiting requests. The scheduler reads the sums through
  :class:`tandem.router.fleet.OtherReplicaLoads` and the admission order through
  :meth:`Ledger.remote_waiters` and :meth:`Ledger.served_tokens`: a replica's view is the whole
  router's, a few milliseconds old;
* **repairs**: every ``snapshot_interval_s`` it writes its full state (reservations, waiters,
  tenants' service and the tokens it placed on each worker lately, released reservations
  included), numbered with the seq of its last message, to
  ``<prefix>:router:ledger:<replica id>`` (TTL ``ttl_s``), and publishes a heartbeat. A receiver
  that sees a gap in a replica's seqs (or that is new, or resubscribed) rebuilds that mirror from
  the snapshot, then applies the messages after it;
* **adopts** a replica whose liveness key ``<prefix>:router:alive:<replica id>`` expired (it
  died): its waiters leave the order (their Schedules failed with it), but its reservations keep
  counting, because the requests they hold are still running on the workers (their gateways
  stream on). They end as they would have: the request's Release reaches a surviving replica
  (Serve's consistent hashing moved it), which publishes it for everyone; or the reservation ages
  past a heartbeat and the worker's own report caps it; or its lease runs out. A dead replica's
  mirror is dropped once it holds nothing and the work it placed lately has decayed (that work
  was done on the workers all the same, and the scorers count it);
* **counts** the other replicas' placements in the tenants' shares
  (:class:`tandem.router.fair_share.TenantShares`, which the scheduler feeds with its own): every
  replica orders its queue by the same global service in uncached prompt tokens.

A Release that reaches a replica not holding the reservation is published to the owner
(:meth:`forward_end`; :meth:`take_forwarded` on the owner). Nothing a retry needs lives only
in one replica: a Schedule retried on another replica is placed afresh.

**Hand-offs.** A queued request travels with what a placement needs (its model, sizes, block
hashes, exclusions: ``payload``), so the replica where budget frees places the best-ranked waiter
of the whole router on the spot, wherever it waits: it reserves the placement as its own and
publishes it to the waiter's replica (:meth:`handed_off`) in the same message as the release that
freed the budget, so no replica ever sees that budget free. The waiter's replica adopts it
(reserves it as its own and forwards the release of the placer's copy, in one message) or, when
the request is no longer waiting, refuses it (forwards the release alone). Before: the replica
left freed budget to the other's waiter, and every replica saw it free until the other's
placement arrived; a request arriving meanwhile elsewhere took it too (the fleet benchmark: ~10 %
of a victim tenant's requests landed on a worker already computing a noisy tenant's prompt).

**Authenticated, bounded.** Every message and snapshot carries an HMAC-SHA256 tag over its exact
bytes, with the secret all replicas are given (:mod:`tandem.router.ledger_auth`, which says what it
does and does not protect against). A receiver drops, and counts in
``tandem_router_ledger_rejected_total{reason}``: a message or snapshot whose tag is missing or wrong
(``bad_mac``) or that does not decode (``malformed``); one sent more than ``max_message_age_s`` ago
or ahead by the clock of the receiver (``stale``); a message whose seq is not above the highest heard
from its sender, or a snapshot older than the last one applied (``replayed``: Redis delivers a
publisher's messages once and in order, so only a replay repeats one); and one from a new replica id
while ``max_replicas`` mirrors exist (``too_many_replicas``). Only an authenticated message or
snapshot makes a mirror, and a mirror that heard nothing for a lease (``lease_s``: every reservation
it could hold has expired) is dropped, so a flood of invented replica ids costs at most
``max_replicas`` mirrors, each holding at most ``MAX_BUFFERED`` messages
(:mod:`tandem.router.ledger_mirror`).

Wire: msgpack, then the tag: the typed messages and snapshots of :mod:`tandem.router.ledger_events`,
which also says what a replica of another version does with them (a rolling upgrade). The mirrors
of the other replicas, and what they are read for, are :mod:`tandem.router.ledger_mirror`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.common import redis_retry
from tandem.router.fair_share import TenantShares
from tandem.router.ledger_auth import LedgerAuth
from tandem.router.ledger_events import (
    Codec,
    Dequeued,
    Ended,
    Event,
    ForwardedEnd,
    HandedOff,
    HandOffPlacement,
    Message,
    Queued,
    Reserved,
    Snapshot,
    WaitingRequest,
)
from tandem.router.ledger_mirror import HandOff, LedgerStats, Mirror, RemoteWaiter, ReplicaMirrors
from tandem.router.metrics import NullRouterMetrics, RouterMetrics
from tandem.router.pubsub import Publisher, subscribe_forever
from tandem.router.reservations import Reservation, ReservationTable

__all__ = ["DEFAULT_MAX_MESSAGE_AGE_S", "DEFAULT_MAX_REPLICAS", "HandOff", "Ledger", "LedgerStats", "RemoteWaiter"]

logger = logging.getLogger(__name__)

#: A flush that cannot publish yet (a snapshot round's write in flight, or no connection) tries again
#: after this long, keeping its events (a snapshot round takes whatever is still there).
_FLUSH_RETRY_S = 0.0005
_FLUSH_RETRY_UNCONNECTED_S = 0.05
#: Replicas mirrored at most (``ledger.max_replicas``); a message from another new id is dropped.
DEFAULT_MAX_REPLICAS = 64
#: A message or snapshot sent longer ago than this (or this far ahead of the receiver's clock) is
#: dropped: a replay of a genuine one after its sender's mirror is gone, or a badly skewed clock.
DEFAULT_MAX_MESSAGE_AGE_S = 30.0


class Ledger:
    """One replica's side of the shared ledger; see the module docstring."""

    def __init__(
        self,
        redis_url: str,
        *,
        key_prefix: str,
        replica_id: str,
        secret: bytes,
        lease_s: float,
        young_s: float,
        recent_half_life_s: float = 30.0,
        flush_interval_s: float = 0.0,
        snapshot_interval_s: float = 0.5,
        ttl_s: float = 3.0,
        shares: TenantShares | None = None,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        max_message_age_s: float = DEFAULT_MAX_MESSAGE_AGE_S,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica_id = replica_id
        self._auth = LedgerAuth(secret)
        self._redis_url = redis_url
        self._redis: aioredis.Redis = redis_retry.connect(redis_url, timeout_s=1.0)
        self._prefix = f"{key_prefix}:router"
        self._channel = f"{self._prefix}:ledger"
        self._publisher = Publisher(redis_url, self._channel, timeout_s=1.0)
        self.flush_interval_s = flush_interval_s
        self.snapshot_interval_s = snapshot_interval_s
        self._ttl_ms = max(1000, int(ttl_s * 1000))
        #: The tenants' service, which this ledger adds the other replicas' placements to.
        self.shares = shares or TenantShares(wall_clock=wall_clock)
        self._clock = clock
        self._wall = wall_clock
        # Ours: what the snapshot holds (reservations come from the scheduler's table at snapshot time).
        self._own_reservations: dict[str, Reserved] = {}
        self._own_waiters: dict[str, Queued] = {}
        #: The scheduler's own table (set by :class:`~tandem.router.scheduler.Scheduler`): the snapshot
        #: carries its recent tokens per worker, released reservations included, so that a mirror
        #: rebuilt from it scores the workers as a mirror that heard every message does.
        self.own_table: ReservationTable | None = None
        self._outbox: list[Event] = []
        self._seq = -1
        self._flush_handle: asyncio.Handle | None = None
        #: A snapshot round's write is in flight: flushes wait, so that its message (taken before them)
        #: is published before theirs.
        self._tick_in_flight = False
        self.stats = LedgerStats()
        self.others = ReplicaMirrors(
            replica_id,
            lease_s=lease_s,
            young_s=young_s,
            recent_half_life_s=recent_half_life_s,
            max_replicas=max_replicas,
            shares=self.shares,
            stats=self.stats,
            auth=self._auth,
            max_message_age_s=max_message_age_s,
            metrics=metrics or NullRouterMetrics(),
            notify=self._notify,
            clock=clock,
            wall_clock=wall_clock,
        )
        self._mirrors: dict[str, Mirror] = self.others.by_id
        #: Seconds from another replica's placement to its arrival here (the last 10,000).
        self.lag_s: deque[float] = self.others.lag_s
        self._tasks: list[asyncio.Task[None]] = []
        # redis-py can swallow a CancelledError that lands inside a command: the loops also stop on this.
        self._closed = False
        #: Called (synchronously) when another replica freed budget, forwarded a Release here, or its
        #: queue changed: the scheduler drains its queue at once instead of at its next poll.
        self.on_change: Callable[[], None] | None = None
        self._codec = Codec()

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()

    @property
    def num_frees(self) -> int:
        """Counts every change that may have freed budget here (see :class:`ReplicaMirrors`)."""
        return self.others.num_frees

    # -- keys --------------------------------------------------------------------------------

    def _alive_key(self, replica_id: str) -> str:
        return f"{self._prefix}:alive:{replica_id}"

    def _snapshot_key(self, replica_id: str) -> str:
        return f"{self._prefix}:ledger:{replica_id}"

    def _replicas_key(self) -> str:
        return f"{self._prefix}:replicas"

    # -- this replica's changes (called by the scheduler; no I/O) -----------------------------

    def reserved(self, reservation: Reservation, num_uncached_tokens: int) -> None:
        now_unix = self._wall()
        event = Reserved(
            request_id=reservation.request_id,
            worker_ids=list(reservation.worker_ids),
            tokens=[int(reservation.tokens_by_worker.get(w, 0)) for w in reservation.worker_ids],
            tenant=reservation.tenant,
            num_uncached_tokens=int(num_uncached_tokens),
            reserved_at_unix=now_unix - (self._clock() - reservation.reserved_at_s),
        )
        self._own_reservations[reservation.request_id] = event
        self._emit(event)

    def reservation_ended(self, reservation: Reservation) -> None:
        if self._own_reservations.pop(reservation.request_id, None) is not None:
            self._emit(Ended(reservation.request_id))

    def queued(
        self,
        request_id: str,
        tenant: str,
        priority_index: int,
        enqueued_at_unix: float,
        payload: WaitingRequest | None = None,
    ) -> None:
        event = Queued(request_id, tenant, int(priority_index), enqueued_at_unix, payload)
        self._own_waiters[request_id] = event
        self._emit(event)

    def dequeued(self, request_id: str) -> None:
        if self._own_waiters.pop(request_id, None) is not None:
            self._emit(Dequeued(request_id))

    def handed_off(self, target_replica_id: str, request_id: str, placement: HandOffPlacement) -> None:
        """This replica placed ``request_id``, which waits in ``target_replica_id``'s queue; publish it
        there (in the same message as the reservation, made just before)."""
        self._emit(HandedOff(request_id, target_replica_id, placement))

    def take_handoffs(self) -> list[HandOff]:
        """Placements other replicas made for this replica's waiters."""
        return self.others.take_handoffs()

    def forward_end_to(self, owner_replica_id: str, request_id: str) -> None:
        """Ask ``owner_replica_id`` to release ``request_id`` (a hand-off adopted or refused); it stops
        counting here at once."""
        self._emit(ForwardedEnd(request_id, owner_replica_id))
        owner = self._mirrors.get(owner_replica_id)
        if owner is not None:
            self.others.ended_elsewhere(owner, request_id)

    def _emit(self, event: Event) -> None:
        self._outbox.append(event)
        if self._flush_handle is None and self._tasks:
            loop = asyncio.get_running_loop()
            if self.flush_interval_s > 0:
                self._flush_handle = loop.call_later(self.flush_interval_s, self._start_flush)
            else:  # at the end of this loop iteration: every change made in it goes in one message
                self._flush_handle = loop.call_soon(self._start_flush)

    def _start_flush(self) -> None:
        self._flush_handle = None
        if not self._outbox:
            return
        if self._tick_in_flight or not self._publisher.connected:
            self._publisher.start()
            retry_s = _FLUSH_RETRY_S if self._publisher.connected else _FLUSH_RETRY_UNCONNECTED_S
            self._flush_handle = asyncio.get_running_loop().call_later(
                max(self.flush_interval_s, retry_s), self._start_flush
            )
            return
        self._flush()

    def _flush(self) -> None:
        events, self._outbox = self._outbox, []
        self._seq += 1
        self._publish(self._message(events))

    def _message(self, events: list[Event]) -> bytes:
        """The next message, sealed (call right after numbering it)."""
        return self._auth.seal_message(self._codec.encode(Message(self.replica_id, self._seq, events, self._wall())))

    def _publish(self, message: bytes) -> None:
        if self._publisher.publish(message):
            self.stats.num_published += 1
        else:  # lost: the receivers see a gap in our seqs and repair from the next snapshot
            self.stats.num_publish_errors += 1

    # -- the other replicas, as the scheduler reads them (see ReplicaMirrors) ------------------

    def others_tokens(self, worker_id: str) -> int:
        return self.others.others_tokens(worker_id)

    def others_young_tokens(self, worker_id: str) -> int:
        return self.others.others_young_tokens(worker_id)

    def others_in_flight(self, worker_id: str) -> int:
        return self.others.others_in_flight(worker_id)

    def others_recent_tokens_at(self, worker_id: str) -> tuple[float, float]:
        now_s = self._clock()
        return self.others.others_recent_tokens(worker_id), now_s

    def others_in_flight_for_tenant(self, tenant: str) -> int:
        return self.others.others_in_flight_for_tenant(tenant)

    def drain_changed(self) -> set[str]:
        return self.others.drain_changed()

    @property
    def has_remote_waiters(self) -> bool:
        """Whether any other replica has a request waiting."""
        return self.others.has_remote_waiters

    def remote_waiters(self) -> Iterator[RemoteWaiter]:
        return self.others.remote_waiters()

    def remote_heads(self, skip: Callable[[str], bool]) -> Iterator[RemoteWaiter]:
        """See :meth:`ReplicaMirrors.remote_heads`."""
        return self.others.remote_heads(skip)

    @property
    def num_live_replicas(self) -> int:
        return 1 + self.others.num_live

    # -- forwarded Releases --------------------------------------------------------------------

    async def forward_end(self, request_id: str) -> bool:
        """Ask the replica holding ``request_id`` to release it; False when no live replica holds it."""
        owner = self.others.owner_of(request_id)
        if owner is None:
            return False
        self._emit(ForwardedEnd(request_id, owner.replica_id))
        self.others.ended_elsewhere(owner, request_id)
        return True

    def take_forwarded(self) -> list[str]:
        """Request ids other replicas asked this one to release."""
        return self.others.take_forwarded()

    # -- receiving -----------------------------------------------------------------------------

    def receive(self, payload: bytes) -> None:
        """Apply one message from the channel (see :meth:`ReplicaMirrors.receive`)."""
        self.others.receive(payload)

    def apply_snapshot(self, replica_id: str, payload: bytes) -> None:
        """Rebuild the mirror of ``replica_id`` from its snapshot (see :meth:`ReplicaMirrors.apply_snapshot`)."""
        self.others.apply_snapshot(replica_id, payload)

    # -- snapshots, liveness -------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Our state as of our last seq (call right after numbering the outbox's events)."""
        return self._auth.seal_snapshot(
            self._codec.encode(
                Snapshot(
                    replica_id=self.replica_id,
                    seq=self._seq,
                    sent_at_unix=self._wall(),
                    reservations=list(self._own_reservations.values()),
                    waiters=list(self._own_waiters.values()),
                    served=self.shares.snapshot(),
                    recent=self._recent_snapshot(),
                )
            )
        )

    def _recent_snapshot(self) -> dict[str, tuple[float, float]]:
        """The own table's recent tokens per worker, each (value, as of a wall-clock time)."""
        if self.own_table is None:
            return {}
        to_unix = self._wall() - self.own_table.now_s()
        return {w: (value, at_s + to_unix) for w, (value, at_s) in self.own_table.recent_by_worker().items()}

    async def tick(self) -> None:
        """One snapshot round: publish what is pending with a heartbeat, write our snapshot and
        liveness, forget dead replicas, repair mirrors that need it."""
        events, self._outbox = self._outbox, []
        self._seq += 1
        message = self._message(events)
        snapshot = self.snapshot()  # no await since the outbox was taken: it matches seq exactly
        # Only replicas mirrored before this read can be found dead by it: a message received while
        # it is in flight may come from a replica that joined after our ZRANGE ran (one CI run: B
        # mirrored A from A's first message, found A missing from its older member list, declared
        # it dead, then revived it at A's next message: two deaths counted for one kill).
        known_before = set(self._mirrors)
        try:
            # Membership, liveness and the snapshot before the message: whoever received it sees us
            # listed. Flushes wait meanwhile, so that the message goes out before theirs.
            self._tick_in_flight = True
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.set(self._alive_key(self.replica_id), b"1", px=self._ttl_ms)
                    pipe.zadd(self._replicas_key(), {self.replica_id: 0})
                    pipe.set(self._snapshot_key(self.replica_id), snapshot, px=self._ttl_ms)
                    pipe.zrange(self._replicas_key(), 0, -1)
                    results = await pipe.execute()
            finally:
                self._tick_in_flight = False
                self._publish(message)
            members = [m.decode() if isinstance(m, bytes) else str(m) for m in results[-1]]
            others = [m for m in members if m != self.replica_id]
            alive = await self._redis.mget([self._alive_key(m) for m in others]) if others else []
        except (RedisError, OSError) as exc:
            self.stats.num_publish_errors += 1
            logger.warning("ledger snapshot failed: %s", exc)
            return
        live = {m for m, flag in zip(others, alive, strict=True) if flag is not None}
        dead = [m for m in others if m not in live]
        repair = self.others.follow_membership(live, known_before)
        try:
            if dead:
                await self._redis.zrem(self._replicas_key(), *dead)
            if repair:
                payloads = await self._redis.mget([self._snapshot_key(r) for r in repair])
                for replica_id, payload in zip(repair, payloads, strict=True):
                    if payload is not None:
                        self.apply_snapshot(replica_id, payload if isinstance(payload, bytes) else payload.encode())
        except (RedisError, OSError) as exc:
            logger.warning("ledger repair failed: %s", exc)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start publishing, listening and the snapshot rounds on the running loop."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._publisher.start()
        self._tasks = [loop.create_task(self._listen_forever()), loop.create_task(self._tick_forever())]
        if self._outbox:
            self._flush_handle = loop.call_later(self.flush_interval_s, self._start_flush)

    async def _tick_forever(self) -> None:
        while not self._closed:
            try:
                await self.tick()
            except Exception:
                logger.exception("ledger tick failed")
            await asyncio.sleep(self.snapshot_interval_s)

    async def _listen_forever(self) -> None:
        # Our own heartbeat comes back on the channel every snapshot round: a subscription that has
        # heard nothing for several rounds is dead without knowing it (a half-open connection).
        await subscribe_forever(
            self._redis_url,
            self._channel,
            lambda payload: self.receive(payload),
            # Anything published before we listened is in the others' snapshots.
            on_subscribed=self.others.resubscribed,
            silent_s=max(2.0, 4 * self.snapshot_interval_s),
            timeout_s=1.0,
            closed=lambda: self._closed,
        )

    async def leave(self) -> None:
        """Clean shutdown: our keys go at once, so the others adopt what we hold without waiting for
        our liveness to expire."""
        with contextlib.suppress(RedisError, OSError):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.delete(self._alive_key(self.replica_id), self._snapshot_key(self.replica_id))
                pipe.zrem(self._replicas_key(), self.replica_id)
                await pipe.execute()

    async def aclose(self) -> None:
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        self._tasks = []
        await self._publisher.aclose()
        await self._redis.aclose()
