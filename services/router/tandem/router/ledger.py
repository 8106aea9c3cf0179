"""What router replicas share, so that they are active-active with one view: every replica's
reservations, waiting requests and the tokens each tenant was served.

The :class:`tandem.router.scheduler.Scheduler` of each replica tells its :class:`Ledger` about
every change as it happens (:meth:`Ledger.reserved`, :meth:`Ledger.released`,
:meth:`Ledger.queued`, :meth:`Ledger.dequeued`: no I/O, they append to an outbox). The ledger:

* **publishes** the outbox on one Redis pub/sub channel as a numbered message ``[replica id,
  seq, events]``: at the end of the event-loop iteration that made the changes (or every
  ``flush_interval_s``, to batch more), as one write on a connection of its own
  (:class:`tandem.router.pubsub.Publisher`), so the messages leave in seq order;
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
(:meth:`forward_release`; :meth:`take_forwarded` on the owner). Nothing a retry needs lives only
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
``max_replicas`` mirrors, each holding at most ``_MAX_BUFFERED`` messages.

Wire: msgpack, then the tag. A message is ``[replica id, seq, events, sent_at_unix]``; a snapshot a
map (below) with ``replica`` and ``at`` (its wall-clock time). Event tuples (issue 39 makes them a
typed union): ``("+", request_id, worker_ids, tokens, tenant, uncached_tokens, reserved_at_unix)``,
``("-", request_id)``, ``("q", request_id, tenant, priority_index, enqueued_at_unix, payload)``,
``("d", request_id)``, ``("r", request_id, owner_replica_id)`` (a forwarded Release),
``("p", request_id, target_replica_id, placement)`` (a hand-off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.common import redis_retry
from tandem.router import ledger_auth
from tandem.router.fair_share import TenantShares
from tandem.router.ledger_auth import LedgerAuth
from tandem.router.metrics import NullRouterMetrics, RouterMetrics
from tandem.router.pubsub import Publisher, Subscription
from tandem.router.reservations import Reservation, ReservationTable

logger = logging.getLogger(__name__)

_RESERVED, _RELEASED, _QUEUED, _DEQUEUED, _FORWARD, _HANDOFF = "+", "-", "q", "d", "r", "p"
#: A flush that cannot publish yet (a snapshot round's write in flight, or no connection) tries again
#: after this long, keeping its events (a snapshot round takes whatever is still there).
_FLUSH_RETRY_S = 0.0005
_FLUSH_RETRY_UNCONNECTED_S = 0.05
#: Messages kept per mirror while it waits for a snapshot to repair a gap.
_MAX_BUFFERED = 10_000
#: Replicas mirrored at most (``ledger.max_replicas``); a message from another new id is dropped.
DEFAULT_MAX_REPLICAS = 64
#: A message or snapshot sent longer ago than this (or this far ahead of the receiver's clock) is
#: dropped: a replay of a genuine one after its sender's mirror is gone, or a badly skewed clock.
DEFAULT_MAX_MESSAGE_AGE_S = 30.0


@dataclass(frozen=True)
class RemoteWaiter:
    """A request waiting for budget in another replica's queue."""

    request_id: str
    tenant: str
    #: Index into the priority classes (0 = highest).
    priority_index: int
    enqueued_at_unix: float
    replica_id: str
    #: What a placement of it needs (the scheduler's encoding; None: not sent, it cannot be placed here).
    payload: Any = None


@dataclass(frozen=True)
class HandOff:
    """A placement another replica made for a request waiting in this replica's queue."""

    request_id: str
    #: The replica that placed it and holds the reservation until this one adopts or refuses it.
    placer_id: str
    #: The scheduler's encoding of the placement.
    placement: Any


@dataclass
class _Mirror:
    """What this replica knows of one other replica."""

    replica_id: str
    table: ReservationTable
    waiters: dict[str, RemoteWaiter] = field(default_factory=dict)
    #: The same waiters by (priority index, tenant), each in the order they were queued: only the
    #: first of each can rank first in the router's order.
    groups: dict[tuple[int, str], dict[str, RemoteWaiter]] = field(default_factory=dict)
    applied_seq: int = -1
    #: No snapshot applied yet, or a gap: messages wait in ``buffered`` until the next snapshot.
    needs_snapshot: bool = True
    buffered: deque[tuple[int, list[Any]]] = field(default_factory=lambda: deque(maxlen=_MAX_BUFFERED))
    #: Its liveness key expired: nothing more will come from it (see the module docstring).
    dead: bool = False
    #: The highest seq heard from it on the channel (the replay guard), and the seq of the last
    #: snapshot of it applied.
    heard_seq: int = -1
    snapshot_seq: int = -1
    #: The ledger's clock when its last authenticated message or snapshot arrived.
    heard_s: float = 0.0

    def add_waiter(self, waiter: RemoteWaiter) -> None:
        self.pop_waiter(waiter.request_id)
        self.waiters[waiter.request_id] = waiter
        self.groups.setdefault((waiter.priority_index, waiter.tenant), {})[waiter.request_id] = waiter

    def pop_waiter(self, request_id: str) -> RemoteWaiter | None:
        waiter = self.waiters.pop(request_id, None)
        if waiter is not None:
            key = (waiter.priority_index, waiter.tenant)
            group = self.groups[key]
            del group[request_id]
            if not group:
                del self.groups[key]
        return waiter

    def clear_waiters(self) -> None:
        self.waiters.clear()
        self.groups.clear()


@dataclass
class LedgerStats:
    num_published: int = 0
    num_publish_errors: int = 0
    num_received: int = 0
    num_gaps: int = 0
    num_snapshots_applied: int = 0
    num_replicas_forgotten: int = 0
    #: Messages and snapshots dropped, by reason (:mod:`tandem.router.ledger_auth`'s ``REJECT_*``).
    rejected: dict[str, int] = field(default_factory=dict)


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
        self._max_replicas = max_replicas
        self._max_message_age_s = max_message_age_s
        self._metrics = metrics or NullRouterMetrics()
        self._redis_url = redis_url
        self._redis: aioredis.Redis = redis_retry.connect(redis_url, timeout_s=1.0)
        self._prefix = f"{key_prefix}:router"
        self._channel = f"{self._prefix}:ledger"
        self._publisher = Publisher(redis_url, self._channel, timeout_s=1.0)
        self._lease_s = lease_s
        self._young_s = young_s
        self._recent_half_life_s = recent_half_life_s
        self.flush_interval_s = flush_interval_s
        self.snapshot_interval_s = snapshot_interval_s
        self._ttl_ms = max(1000, int(ttl_s * 1000))
        #: The tenants' service, which this ledger adds the other replicas' placements to.
        self.shares = shares or TenantShares(wall_clock=wall_clock)
        self._clock = clock
        self._wall = wall_clock
        # Ours: what the snapshot holds (reservations come from the scheduler's table at snapshot time).
        self._own_reservations: dict[str, tuple[Any, ...]] = {}
        self._own_waiters: dict[str, tuple[Any, ...]] = {}
        #: The scheduler's own table (set by :class:`~tandem.router.scheduler.Scheduler`): the snapshot
        #: carries its recent tokens per worker, released reservations included, so that a mirror
        #: rebuilt from it scores the workers as a mirror that heard every message does.
        self.own_table: ReservationTable | None = None
        self._outbox: list[tuple[Any, ...]] = []
        self._seq = -1
        self._flush_handle: asyncio.Handle | None = None
        #: A snapshot round's write is in flight: flushes wait, so that its message (taken before them)
        #: is published before theirs.
        self._tick_in_flight = False
        self._mirrors: dict[str, _Mirror] = {}
        self._changed: set[str] = set()
        self._forwarded: list[str] = []
        self._handoffs: list[HandOff] = []
        #: Counts every change here that may have freed budget (a reservation of another replica
        #: released or expired, a mirror rebuilt): a scheduler retries a request that did not fit only
        #: once this moved (or time passed).
        self.num_frees = 0
        self._tasks: list[asyncio.Task[None]] = []
        # redis-py can swallow a CancelledError that lands inside a command: the loops also stop on this.
        self._closed = False
        self.stats = LedgerStats()
        #: Seconds from another replica's placement to its arrival here (the last 10,000).
        self.lag_s: deque[float] = deque(maxlen=10_000)
        #: Called (synchronously) when another replica freed budget, forwarded a Release here, or its
        #: queue changed: the scheduler drains its queue at once instead of at its next poll.
        self.on_change: Callable[[], None] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()
        #: How every message of ours begins (a 4-array, then our id with its length): the channel hands
        #: each publisher its own messages back, one per flush, and they are dropped undecoded.
        self._own_prefix = b"\x94" + msgspec.msgpack.encode(replica_id)

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
        reserved_at_unix = now_unix - (self._clock() - reservation.reserved_at_s)
        event = (
            _RESERVED,
            reservation.request_id,
            list(reservation.worker_ids),
            [int(reservation.tokens_by_worker.get(w, 0)) for w in reservation.worker_ids],
            reservation.tenant,
            int(num_uncached_tokens),
            reserved_at_unix,
        )
        self._own_reservations[reservation.request_id] = event
        self._emit(event)

    def released(self, reservation: Reservation) -> None:
        if self._own_reservations.pop(reservation.request_id, None) is not None:
            self._emit((_RELEASED, reservation.request_id))

    def queued(
        self, request_id: str, tenant: str, priority_index: int, enqueued_at_unix: float, payload: Any = None
    ) -> None:
        event = (_QUEUED, request_id, tenant, int(priority_index), enqueued_at_unix, payload)
        self._own_waiters[request_id] = event
        self._emit(event)

    def dequeued(self, request_id: str) -> None:
        if self._own_waiters.pop(request_id, None) is not None:
            self._emit((_DEQUEUED, request_id))

    def handed_off(self, target_replica_id: str, request_id: str, placement: Any) -> None:
        """This replica placed ``request_id``, which waits in ``target_replica_id``'s queue; publish it
        there (in the same message as the reservation, made just before)."""
        self._emit((_HANDOFF, request_id, target_replica_id, placement))

    def take_handoffs(self) -> list[HandOff]:
        """Placements other replicas made for this replica's waiters."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def forward_release_to(self, owner_replica_id: str, request_id: str) -> None:
        """Ask ``owner_replica_id`` to release ``request_id`` (a hand-off adopted or refused); it stops
        counting here at once."""
        self._emit((_FORWARD, request_id, owner_replica_id))
        owner = self._mirrors.get(owner_replica_id)
        if owner is not None:
            self._released_elsewhere(owner, request_id)

    def _emit(self, event: tuple[Any, ...]) -> None:
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

    def _message(self, events: list[tuple[Any, ...]]) -> bytes:
        """The next message, sealed (call right after numbering it)."""
        return self._auth.seal_message(self._encoder.encode([self.replica_id, self._seq, events, self._wall()]))

    def _publish(self, message: bytes) -> None:
        if self._publisher.publish(message):
            self.stats.num_published += 1
        else:  # lost: the receivers see a gap in our seqs and repair from the next snapshot
            self.stats.num_publish_errors += 1

    # -- the other replicas, as the scheduler reads them ---------------------------------------

    def others_tokens(self, worker_id: str) -> int:
        return sum(m.table.num_tokens_in_flight(worker_id) for m in self._mirrors.values())

    def others_young_tokens(self, worker_id: str) -> int:
        total = 0
        for mirror in self._mirrors.values():
            total += mirror.table.token_snapshot()[1].get(worker_id, 0)
        return total

    def others_in_flight(self, worker_id: str) -> int:
        return sum(m.table.num_in_flight(worker_id) for m in self._mirrors.values())

    def others_recent_tokens_at(self, worker_id: str) -> tuple[float, float]:
        now_s = self._clock()
        return sum(m.table.recent_tokens(worker_id) for m in self._mirrors.values()), now_s

    def others_in_flight_for_tenant(self, tenant: str) -> int:
        return sum(m.table.num_in_flight_for_tenant(tenant) for m in self._mirrors.values())

    def drain_changed(self) -> set[str]:
        changed = self._changed
        for mirror in self._mirrors.values():
            changed |= mirror.table.drain_changed()
        self._changed = set()
        return changed

    @property
    def has_remote_waiters(self) -> bool:
        """Whether any other replica has a request waiting."""
        return any(m.waiters for m in self._mirrors.values())

    def remote_waiters(self) -> Iterator[RemoteWaiter]:
        for mirror in self._mirrors.values():
            yield from mirror.waiters.values()

    def remote_heads(self, skip: Callable[[str], bool]) -> Iterator[RemoteWaiter]:
        """Per other replica and (class, tenant), its longest-waiting request for which ``skip`` is
        false: the only ones that can rank first (a replica's waiters of one tenant and class are in
        the order they were queued), without a pass over every waiter."""
        for mirror in self._mirrors.values():
            for group in mirror.groups.values():
                for waiter in group.values():
                    if not skip(waiter.request_id):
                        yield waiter
                        break

    @property
    def num_live_replicas(self) -> int:
        return 1 + sum(1 for m in self._mirrors.values() if not m.dead)

    # -- forwarded Releases --------------------------------------------------------------------

    async def forward_release(self, request_id: str) -> bool:
        """Ask the replica holding ``request_id`` to release it; False when no live replica holds it."""
        owner = next((m for m in self._mirrors.values() if m.table.get(request_id) is not None), None)
        if owner is None:
            return False
        self._emit((_FORWARD, request_id, owner.replica_id))
        self._released_elsewhere(owner, request_id)
        return True

    def _released_elsewhere(self, owner: _Mirror, request_id: str) -> None:
        """``request_id`` of ``owner`` was released through another replica: its request ended, so it
        stops counting here at once (the owner's own release, when it comes, finds nothing more to
        do; an owner that died never sends one)."""
        if owner.table.release(request_id) is not None:
            self.num_frees += 1
            if self.on_change is not None:
                self.on_change()

    def take_forwarded(self) -> list[str]:
        """Request ids other replicas asked this one to release."""
        forwarded, self._forwarded = self._forwarded, []
        return forwarded

    # -- receiving -----------------------------------------------------------------------------

    def _mirror(self, replica_id: str) -> _Mirror | None:
        """The mirror of ``replica_id``, made if new (call only for an authenticated sender); None when
        ``max_replicas`` mirrors exist already."""
        mirror = self._mirrors.get(replica_id)
        if mirror is None:
            if len(self._mirrors) >= self._max_replicas:
                return None
            table = ReservationTable(
                lease_s=self._lease_s,
                clock=self._clock,
                young_s=self._young_s,
                recent_half_life_s=self._recent_half_life_s,
            )
            mirror = self._mirrors[replica_id] = _Mirror(replica_id, table, heard_s=self._clock())
        return mirror

    def _reject(self, reason: str, what: str) -> None:
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        self._metrics.count_ledger_rejected(reason)
        # One line per reason and power of two: a flood is visible without flooding the log.
        count = self.stats.rejected[reason]
        if count & (count - 1) == 0:
            logger.warning("ledger: dropped a %s (%s; %d so far)", what, reason, count)

    def _fresh(self, sent_at_unix: float) -> bool:
        return abs(self._wall() - sent_at_unix) <= self._max_message_age_s

    def receive(self, payload: bytes) -> None:
        """Apply one message from the channel (ours are ignored; see the module docstring for what is
        dropped)."""
        if payload.startswith(self._own_prefix):
            return
        body = self._auth.open_message(payload)
        if body is None:
            self._reject(ledger_auth.REJECT_BAD_MAC, "message")
            return
        try:
            replica_id, seq, events, sent_at_unix = self._decoder.decode(body)
            seq, sent_at_unix = int(seq), float(sent_at_unix)
            replica_id = str(replica_id)
        except (msgspec.DecodeError, ValueError, TypeError):
            self._reject(ledger_auth.REJECT_MALFORMED, "message")
            return
        if replica_id == self.replica_id:
            return
        if not self._fresh(sent_at_unix):
            self._reject(ledger_auth.REJECT_STALE, "message")
            return
        mirror = self._mirror(replica_id)
        if mirror is None:
            self._reject(ledger_auth.REJECT_TOO_MANY_REPLICAS, "message")
            return
        if seq <= mirror.heard_seq:
            self._reject(ledger_auth.REJECT_REPLAYED, "message")
            return
        mirror.heard_seq = seq
        mirror.heard_s = self._clock()
        self.stats.num_received += 1
        # Forwarded Releases are requests, not state (no snapshot carries them): act on them at once,
        # whatever the state of the sender's mirror.
        forwarded = [e[1] for e in events if e[0] == _FORWARD and e[2] == self.replica_id]
        handoffs = [HandOff(e[1], replica_id, e[3]) for e in events if e[0] == _HANDOFF and e[2] == self.replica_id]
        if forwarded or handoffs:
            self._forwarded.extend(forwarded)
            self._handoffs.extend(handoffs)
            if self.on_change is not None:
                self.on_change()
        for event in events:
            if event[0] == _FORWARD and event[2] != self.replica_id and event[2] in self._mirrors:
                self._released_elsewhere(self._mirrors[event[2]], event[1])
        if mirror.dead and seq > mirror.applied_seq:  # it speaks again (a partition healed): follow it afresh
            mirror.dead = False
            mirror.needs_snapshot = True
        if mirror.needs_snapshot:
            mirror.buffered.append((seq, events))
            return
        if seq <= mirror.applied_seq:
            return
        if seq > mirror.applied_seq + 1:
            self.stats.num_gaps += 1
            mirror.needs_snapshot = True
            mirror.buffered.append((seq, events))
            return
        self._apply(mirror, seq, events)

    def _apply(self, mirror: _Mirror, seq: int, events: Iterable[list[Any]]) -> None:
        mirror.applied_seq = seq
        notify = False
        for event in events:
            kind = event[0]
            if kind == _RESERVED:
                _, request_id, worker_ids, tokens, tenant, uncached, reserved_at_unix = event
                self.lag_s.append(self._wall() - float(reserved_at_unix))
                self._mirror_reserve(mirror, request_id, worker_ids, tokens, tenant, reserved_at_unix)
                self.shares.add(tenant, int(uncached), float(reserved_at_unix))
            elif kind == _RELEASED:
                if mirror.table.release(event[1]) is not None:
                    notify = True
                    self.num_frees += 1
            elif kind == _QUEUED:
                mirror.add_waiter(_remote_waiter(event, mirror.replica_id))
                notify = True
            elif kind == _DEQUEUED:
                notify |= mirror.pop_waiter(event[1]) is not None
        if notify and self.on_change is not None:
            self.on_change()

    def _mirror_reserve(
        self,
        mirror: _Mirror,
        request_id: str,
        worker_ids: list[str],
        tokens: list[int],
        tenant: str,
        reserved_at_unix: float,
    ) -> None:
        age_s = max(0.0, self._wall() - float(reserved_at_unix))
        mirror.table.reserve(
            request_id,
            tuple(worker_ids),
            dict(zip(worker_ids, tokens, strict=False)),
            tenant=tenant,
            reserved_at_s=self._clock() - age_s,
        )

    def apply_snapshot(self, replica_id: str, payload: bytes) -> None:
        """Rebuild the mirror of ``replica_id`` from its snapshot, then the messages buffered after it."""
        body = self._auth.open_snapshot(payload)
        if body is None:
            self._reject(ledger_auth.REJECT_BAD_MAC, "snapshot")
            return
        try:
            snapshot = self._decoder.decode(body)
            seq = int(snapshot["seq"])
            sent_at_unix = float(snapshot["at"])
            # A snapshot of another replica copied under this one's key is not this one's.
            if snapshot["replica"] != replica_id:
                raise ValueError("another replica's snapshot")
        except (msgspec.DecodeError, ValueError, TypeError, KeyError):
            self._reject(ledger_auth.REJECT_MALFORMED, "snapshot")
            return
        if not self._fresh(sent_at_unix):
            self._reject(ledger_auth.REJECT_STALE, "snapshot")
            return
        old = self._mirrors.get(replica_id)
        if old is not None and seq < old.snapshot_seq:
            self._reject(ledger_auth.REJECT_REPLAYED, "snapshot")
            return
        if old is None and len(self._mirrors) >= self._max_replicas:
            self._reject(ledger_auth.REJECT_TOO_MANY_REPLICAS, "snapshot")
            return
        self.num_frees += 1
        self._mirrors.pop(replica_id, None)
        if old is not None:
            self._changed.update(w for r in old.table.reservations() for w in r.worker_ids)
            self._changed.update(old.table.recent_worker_ids())
        mirror = self._mirror(replica_id)
        assert mirror is not None  # a slot was checked above, and the old mirror's freed
        # Only messages raise the replay guard: this snapshot's own message may still be on its way
        # (the snapshot is written before it is published).
        mirror.heard_seq = old.heard_seq if old is not None else -1
        mirror.snapshot_seq = seq
        for event in snapshot.get("reservations", ()):
            _, request_id, worker_ids, tokens, tenant, _uncached, reserved_at_unix = event
            self._mirror_reserve(mirror, request_id, worker_ids, tokens, tenant, reserved_at_unix)
        for event in snapshot.get("waiters", ()):
            mirror.add_waiter(_remote_waiter(event, replica_id))
        # The work it placed lately, released reservations included, replaces what re-reserving the
        # live ones just added (they are in it). Without it every repair reset this replica's view of
        # the other's recent work to what was in flight, and the decode scores of the two replicas
        # parted for the rest of the half-life (the fleet benchmark: agreement with the one-replica
        # oracle 0.82-0.84 instead of 0.99 in one replay of five). Older senders omit the field.
        now_unix, now_s = self._wall(), self._clock()
        for worker_id, (value, at_unix) in snapshot.get("recent", {}).items():
            mirror.table.set_recent_tokens(worker_id, float(value), now_s - (now_unix - float(at_unix)))
        for tenant, (value, at_unix) in snapshot.get("served", {}).items():
            self.shares.learn(tenant, float(value), float(at_unix))  # a new replica learns the history
        mirror.applied_seq = seq
        mirror.needs_snapshot = False
        buffered = sorted((m for m in (old.buffered if old else ()) if m[0] > seq), key=lambda m: m[0])
        for message_seq, events in buffered:
            if message_seq != mirror.applied_seq + 1:
                mirror.needs_snapshot = True  # still a hole: wait for the next snapshot
                mirror.buffered.extend(m for m in buffered if m[0] >= message_seq)
                break
            self._apply(mirror, message_seq, events)
        self.stats.num_snapshots_applied += 1
        if self.on_change is not None:
            self.on_change()

    def declare_dead(self, replica_id: str) -> None:
        """``replica_id`` died: its waiters leave the order; its reservations are adopted (see the
        module docstring)."""
        mirror = self._mirrors.get(replica_id)
        if mirror is None or mirror.dead:
            return
        mirror.dead = True
        mirror.clear_waiters()
        self.stats.num_replicas_forgotten += 1
        self._drop_if_empty(mirror)
        if self.on_change is not None:
            self.on_change()

    #: A dead replica's mirror goes once no worker's recent tokens from it exceed this: the work it
    #: placed was done on the workers all the same, and a survivor that forgot it at once saw those
    #: workers idler than the work placed on them says (the fleet benchmark: agreement with the
    #: one-replica oracle fell from 0.97 to 0.65 after a kill, for the recent-work half-life).
    _FORGET_BELOW_RECENT_TOKENS = 1.0

    def _drop_if_empty(self, mirror: _Mirror) -> None:
        for reservation in mirror.table.sweep():
            self._changed.update(reservation.worker_ids)
            self.num_frees += 1
        if (
            mirror.dead
            and not len(mirror.table)
            and mirror.table.max_recent_tokens() < self._FORGET_BELOW_RECENT_TOKENS
        ):
            self._forget(mirror)

    def _forget(self, mirror: _Mirror) -> None:
        self._changed |= mirror.table.drain_changed()
        self._changed.update(w for r in mirror.table.reservations() for w in r.worker_ids)
        self._changed.update(mirror.table.recent_worker_ids())
        del self._mirrors[mirror.replica_id]
        self.num_frees += 1

    # -- snapshots, liveness -------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Our state as of our last seq (call right after numbering the outbox's events)."""
        return self._auth.seal_snapshot(
            self._encoder.encode(
                {
                    "replica": self.replica_id,
                    "seq": self._seq,
                    "at": self._wall(),
                    "reservations": list(self._own_reservations.values()),
                    "waiters": list(self._own_waiters.values()),
                    "served": self.shares.snapshot(),
                    "recent": self._recent_snapshot(),
                }
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
        for replica_id in [r for r in self._mirrors if r in known_before and r not in live]:
            self.declare_dead(replica_id)
        for mirror in [m for m in self._mirrors.values() if m.dead]:
            self._drop_if_empty(mirror)
        # Silent for a lease: every reservation it could hold has expired (a mirror made by messages
        # alone, of an id never listed live, is otherwise only dropped once found dead and empty).
        now_s = self._clock()
        for mirror in [m for m in self._mirrors.values() if now_s - m.heard_s > self._lease_s]:
            self._forget(mirror)
        try:
            if dead:
                await self._redis.zrem(self._replicas_key(), *dead)
            # (a replica seen for the first time is mirrored from its snapshot, while mirrors are left)
            new = [r for r in live if r not in self._mirrors][: max(0, self._max_replicas - len(self._mirrors))]
            repair = [r for r, m in self._mirrors.items() if r in live and m.needs_snapshot] + new
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
        silent_s = max(2.0, 4 * self.snapshot_interval_s)
        while not self._closed:
            subscription: Subscription | None = None
            try:
                subscription = await Subscription.open(
                    self._redis_url, self._channel, lambda payload: self.receive(payload), timeout_s=1.0
                )
                # Anything published before we listened is in the others' snapshots.
                for mirror in self._mirrors.values():
                    mirror.needs_snapshot = True
                while not self._closed:
                    if await subscription.wait_closed(silent_s):
                        logger.warning("ledger subscription lost: Redis closed the connection")
                        await asyncio.sleep(0.5)
                        break
                    if time.monotonic() - subscription.heard_s > silent_s:
                        logger.warning("ledger subscription silent for %.1f s; subscribing again", silent_s)
                        break
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, TimeoutError) as exc:
                logger.warning("ledger subscription lost: %s", exc)
                await asyncio.sleep(0.5)
            finally:
                if subscription is not None:
                    subscription.close()

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


def _remote_waiter(event: list[Any], replica_id: str) -> RemoteWaiter:
    """A ``("q", ...)`` event as a RemoteWaiter (one without a payload came from an older replica)."""
    _, request_id, tenant, priority_index, enqueued_at_unix, *rest = event
    return RemoteWaiter(
        request_id, tenant, int(priority_index), float(enqueued_at_unix), replica_id, rest[0] if rest else None
    )
