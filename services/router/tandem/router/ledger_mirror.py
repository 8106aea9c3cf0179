"""What one router replica knows of the others: a mirror per other replica, kept from the messages
and snapshots they publish (:mod:`tandem.router.ledger_events`).

Owned by :class:`tandem.router.ledger.Ledger`, which hands it what arrives on the channel and the
snapshots it reads (:meth:`ReplicaMirrors.receive`, :meth:`ReplicaMirrors.apply_snapshot`: checked
with :mod:`tandem.router.ledger_auth`, decoded, and dropped and counted when forged, malformed,
stale, replayed or one replica too many), tells it
which replicas are alive after each snapshot round (:meth:`ReplicaMirrors.follow_membership`), and
serves the scheduler the sums read here (``others_*``, :meth:`ReplicaMirrors.remote_heads`). No
I/O. Each mirror's reservations are a :class:`~tandem.router.reservations.ReservationTable`, so
another replica's tokens, young tokens, requests in flight and recently placed tokens per worker
come out of the same code as this replica's own. Why a mirror is made, repaired, adopted and
dropped the way it is: :mod:`tandem.router.ledger`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import msgspec

from tandem.router import ledger_auth, ledger_events
from tandem.router.fair_share import TenantShares
from tandem.router.ledger_auth import LedgerAuth
from tandem.router.metrics import RouterMetrics
from tandem.router.reservations import ReservationTable

logger = logging.getLogger(__name__)

#: Messages kept per mirror while it waits for a snapshot to repair a gap.
MAX_BUFFERED = 10_000


@dataclass(frozen=True)
class RemoteWaiter:
    """A request waiting for budget in another replica's queue."""

    request_id: str
    tenant: str
    #: Index into the priority classes (0 = highest).
    priority_index: int
    enqueued_at_unix: float
    replica_id: str
    #: What a placement of it needs (None: not sent, it cannot be placed here).
    payload: ledger_events.WaitingRequest | None = None


@dataclass(frozen=True)
class HandOff:
    """A placement another replica made for a request waiting in this replica's queue."""

    request_id: str
    #: The replica that placed it and holds the reservation until this one adopts or refuses it.
    placer_id: str
    placement: ledger_events.HandOffPlacement


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


@dataclass
class Mirror:
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
    buffered: deque[tuple[int, list[ledger_events.Event]]] = field(default_factory=lambda: deque(maxlen=MAX_BUFFERED))
    #: Its liveness key expired: nothing more will come from it (see :mod:`tandem.router.ledger`).
    dead: bool = False
    #: The highest seq heard from it on the channel (the replay guard), and the seq of the last
    #: snapshot of it applied.
    heard_seq: int = -1
    snapshot_seq: int = -1
    #: The ledger's clock when its last authenticated message or snapshot arrived.
    heard_s: float = 0.0

    def add_waiter(self, event: ledger_events.Queued) -> None:
        waiter = RemoteWaiter(
            event.request_id, event.tenant, event.priority_index, event.enqueued_at_unix, self.replica_id, event.payload
        )
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


class ReplicaMirrors:
    """The mirrors of every other replica; see the module docstring."""

    #: A dead replica's mirror goes once no worker's recent tokens from it exceed this: the work it
    #: placed was done on the workers all the same, and a survivor that forgot it at once saw those
    #: workers idler than the work placed on them says (the fleet benchmark: agreement with the
    #: one-replica oracle fell from 0.97 to 0.65 after a kill, for the recent-work half-life).
    _FORGET_BELOW_RECENT_TOKENS = 1.0

    def __init__(
        self,
        replica_id: str,
        *,
        lease_s: float,
        young_s: float,
        recent_half_life_s: float,
        max_replicas: int,
        shares: TenantShares,
        stats: LedgerStats,
        auth: LedgerAuth,
        max_message_age_s: float,
        metrics: RouterMetrics,
        notify: Callable[[], None],
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.replica_id = replica_id
        self._lease_s = lease_s
        self._young_s = young_s
        self._recent_half_life_s = recent_half_life_s
        self._max_replicas = max_replicas
        self._shares = shares
        self._stats = stats
        self._auth = auth
        self._max_message_age_s = max_message_age_s
        self._metrics = metrics
        self._codec = ledger_events.Codec()
        #: How every message of ours begins (a 4-array, then our id with its length): the channel hands
        #: each publisher its own messages back, one per flush, and they are dropped undecoded.
        self._own_prefix = b"\x94" + msgspec.msgpack.encode(replica_id)
        self._notify = notify
        self._clock = clock
        self._wall = wall_clock
        #: By replica id (never rebound: the ledger and tests keep a reference).
        self.by_id: dict[str, Mirror] = {}
        self._changed: set[str] = set()
        self._forwarded: list[str] = []
        self._handoffs: list[HandOff] = []
        #: Counts every change here that may have freed budget (a reservation of another replica
        #: released or expired, a mirror rebuilt): a scheduler retries a request that did not fit only
        #: once this moved (or time passed).
        self.num_frees = 0
        #: Seconds from another replica's placement to its arrival here (the last 10,000).
        self.lag_s: deque[float] = deque(maxlen=10_000)

    def mirror(self, replica_id: str) -> Mirror | None:
        """The mirror of ``replica_id``, made if new (call only for an authenticated sender); None when
        ``max_replicas`` mirrors exist already."""
        mirror = self.by_id.get(replica_id)
        if mirror is None:
            if len(self.by_id) >= self._max_replicas:
                return None
            table = ReservationTable(
                lease_s=self._lease_s,
                clock=self._clock,
                young_s=self._young_s,
                recent_half_life_s=self._recent_half_life_s,
            )
            mirror = self.by_id[replica_id] = Mirror(replica_id, table, heard_s=self._clock())
        return mirror

    # -- receiving -----------------------------------------------------------------------------

    def _reject(self, reason: str, what: str) -> None:
        self._stats.rejected[reason] = self._stats.rejected.get(reason, 0) + 1
        self._metrics.count_ledger_rejected(reason)
        # One line per reason and power of two: a flood is visible without flooding the log.
        count = self._stats.rejected[reason]
        if count & (count - 1) == 0:
            logger.warning("ledger: dropped a %s (%s; %d so far)", what, reason, count)

    def _fresh(self, sent_at_unix: float) -> bool:
        return abs(self._wall() - sent_at_unix) <= self._max_message_age_s

    def receive(self, payload: bytes) -> None:
        """Apply one message from the channel (ours are ignored; see :mod:`tandem.router.ledger` for
        what is dropped). Never raises for what arrives: a message that does not decode is counted."""
        if payload.startswith(self._own_prefix):
            return
        body = self._auth.open_message(payload)
        if body is None:
            self._reject(ledger_auth.REJECT_BAD_MAC, "message")
            return
        try:
            message = self._codec.decode_message(body)
        except msgspec.DecodeError:  # (ValidationError derives from it)
            self._reject(ledger_auth.REJECT_MALFORMED, "message")
            return
        if message.replica_id == self.replica_id:
            return
        if not self._fresh(message.sent_at_unix):
            self._reject(ledger_auth.REJECT_STALE, "message")
            return
        self._receive_message(message)

    def _receive_message(self, message: ledger_events.Message) -> None:
        mirror = self.mirror(message.replica_id)
        if mirror is None:
            self._reject(ledger_auth.REJECT_TOO_MANY_REPLICAS, "message")
            return
        seq, events = message.seq, message.events
        if seq <= mirror.heard_seq:
            self._reject(ledger_auth.REJECT_REPLAYED, "message")
            return
        mirror.heard_seq = seq
        mirror.heard_s = self._clock()
        self._stats.num_received += 1
        # Forwarded Releases and hand-offs are requests, not state (no snapshot carries them): act on
        # them at once, whatever the state of the sender's mirror.
        mine = self.replica_id
        forwarded = [
            e.request_id for e in events if type(e) is ledger_events.ForwardedEnd and e.owner_replica_id == mine
        ]
        handoffs = [
            HandOff(e.request_id, message.replica_id, e.placement)
            for e in events
            if type(e) is ledger_events.HandedOff and e.target_replica_id == mine
        ]
        if forwarded or handoffs:
            self._forwarded.extend(forwarded)
            self._handoffs.extend(handoffs)
            self._notify()
        for event in events:
            if type(event) is ledger_events.ForwardedEnd and event.owner_replica_id != mine:
                owner = self.by_id.get(event.owner_replica_id)
                if owner is not None:
                    self.ended_elsewhere(owner, event.request_id)
        if mirror.dead and seq > mirror.applied_seq:  # it speaks again (a partition healed): follow it afresh
            mirror.dead = False
            mirror.needs_snapshot = True
        if mirror.needs_snapshot:
            mirror.buffered.append((seq, events))
            return
        if seq <= mirror.applied_seq:
            return
        if seq > mirror.applied_seq + 1:
            self._stats.num_gaps += 1
            mirror.needs_snapshot = True
            mirror.buffered.append((seq, events))
            return
        self._apply(mirror, seq, events)

    def _apply(self, mirror: Mirror, seq: int, events: Iterable[ledger_events.Event]) -> None:
        mirror.applied_seq = seq
        notify = False
        for event in events:
            if type(event) is ledger_events.Reserved:
                self.lag_s.append(self._wall() - event.reserved_at_unix)
                self._reserve(mirror, event)
                self._shares.add(event.tenant, event.num_uncached_tokens, event.reserved_at_unix)
            elif type(event) is ledger_events.Ended:
                if mirror.table.end(event.request_id) is not None:
                    notify = True
                    self.num_frees += 1
            elif type(event) is ledger_events.Queued:
                mirror.add_waiter(event)
                notify = True
            elif type(event) is ledger_events.Dequeued:
                notify |= mirror.pop_waiter(event.request_id) is not None
        if notify:
            self._notify()

    def _reserve(self, mirror: Mirror, event: ledger_events.Reserved) -> None:
        age_s = max(0.0, self._wall() - event.reserved_at_unix)
        mirror.table.reserve(
            event.request_id,
            tuple(event.worker_ids),
            dict(zip(event.worker_ids, event.tokens, strict=False)),
            tenant=event.tenant,
            reserved_at_s=self._clock() - age_s,
        )

    def apply_snapshot(self, replica_id: str, payload: bytes) -> None:
        """Rebuild the mirror of ``replica_id`` from its snapshot, then the messages buffered after it."""
        body = self._auth.open_snapshot(payload)
        if body is None:
            self._reject(ledger_auth.REJECT_BAD_MAC, "snapshot")
            return
        try:
            snapshot = self._codec.decode_snapshot(body)
        except msgspec.DecodeError:
            self._reject(ledger_auth.REJECT_MALFORMED, "snapshot")
            return
        # A snapshot of another replica copied under this one's key is not this one's.
        if snapshot.replica_id != replica_id:
            self._reject(ledger_auth.REJECT_MALFORMED, "snapshot")
            return
        if not self._fresh(snapshot.sent_at_unix):
            self._reject(ledger_auth.REJECT_STALE, "snapshot")
            return
        seq = snapshot.seq
        old = self.by_id.get(replica_id)
        if old is not None and seq < old.snapshot_seq:
            self._reject(ledger_auth.REJECT_REPLAYED, "snapshot")
            return
        if old is None and len(self.by_id) >= self._max_replicas:
            self._reject(ledger_auth.REJECT_TOO_MANY_REPLICAS, "snapshot")
            return
        self.num_frees += 1
        self.by_id.pop(replica_id, None)
        if old is not None:
            self._changed.update(w for r in old.table.reservations() for w in r.worker_ids)
            self._changed.update(old.table.recent_worker_ids())
        mirror = self.mirror(replica_id)
        assert mirror is not None  # a slot was checked above, and the old mirror's freed
        # Only messages raise the replay guard: this snapshot's own message may still be on its way
        # (the snapshot is written before it is published).
        mirror.heard_seq = old.heard_seq if old is not None else -1
        mirror.snapshot_seq = seq
        for reserved in snapshot.reservations:
            self._reserve(mirror, reserved)
        for queued in snapshot.waiters:
            mirror.add_waiter(queued)
        # The work it placed lately, released reservations included, replaces what re-reserving the
        # live ones just added (they are in it). Without it every repair reset this replica's view of
        # the other's recent work to what was in flight, and the decode scores of the two replicas
        # parted for the rest of the half-life (the fleet benchmark: agreement with the one-replica
        # oracle 0.82-0.84 instead of 0.99 in one replay of five). Older senders omit the field.
        now_unix, now_s = self._wall(), self._clock()
        for worker_id, (value, at_unix) in snapshot.recent.items():
            mirror.table.set_recent_tokens(worker_id, value, now_s - (now_unix - at_unix))
        for tenant, (value, at_unix) in snapshot.served.items():
            self._shares.learn(tenant, value, at_unix)  # a new replica learns the history
        mirror.applied_seq = seq
        mirror.needs_snapshot = False
        buffered = sorted((m for m in (old.buffered if old else ()) if m[0] > seq), key=lambda m: m[0])
        for message_seq, events in buffered:
            if message_seq != mirror.applied_seq + 1:
                mirror.needs_snapshot = True  # still a hole: wait for the next snapshot
                mirror.buffered.extend(m for m in buffered if m[0] >= message_seq)
                break
            self._apply(mirror, message_seq, events)
        self._stats.num_snapshots_applied += 1
        self._notify()

    # -- membership ----------------------------------------------------------------------------

    def follow_membership(self, live: set[str], known_before: set[str]) -> list[str]:
        """After a snapshot round found ``live`` replicas alive: those mirrored since before it and not
        live died; dead and empty mirrors go, and mirrors silent for a lease. Returns the live
        replicas to read a snapshot of (a gap to repair, or new while there is room)."""
        for replica_id in [r for r in self.by_id if r in known_before and r not in live]:
            self.declare_dead(replica_id)
        for mirror in [m for m in self.by_id.values() if m.dead]:
            self._drop_if_empty(mirror)
        # Silent for a lease: every reservation it could hold has expired (a mirror made by messages
        # alone, of an id never listed live, is otherwise only dropped once found dead and empty).
        now_s = self._clock()
        for mirror in [m for m in self.by_id.values() if now_s - m.heard_s > self._lease_s]:
            self._forget(mirror)
        # (a replica seen for the first time is mirrored from its snapshot, while mirrors are left)
        new = [r for r in live if r not in self.by_id][: max(0, self._max_replicas - len(self.by_id))]
        return [r for r, m in self.by_id.items() if r in live and m.needs_snapshot] + new

    def resubscribed(self) -> None:
        """The channel was (re)subscribed: anything published before is in the others' snapshots."""
        for mirror in self.by_id.values():
            mirror.needs_snapshot = True

    def declare_dead(self, replica_id: str) -> None:
        """``replica_id`` died: its waiters leave the order; its reservations are adopted (see
        :mod:`tandem.router.ledger`)."""
        mirror = self.by_id.get(replica_id)
        if mirror is None or mirror.dead:
            return
        mirror.dead = True
        mirror.clear_waiters()
        self._stats.num_replicas_forgotten += 1
        self._drop_if_empty(mirror)
        self._notify()

    def _drop_if_empty(self, mirror: Mirror) -> None:
        for reservation in mirror.table.sweep():
            self._changed.update(reservation.worker_ids)
            self.num_frees += 1
        if (
            mirror.dead
            and not len(mirror.table)
            and mirror.table.max_recent_tokens() < self._FORGET_BELOW_RECENT_TOKENS
        ):
            self._forget(mirror)

    def _forget(self, mirror: Mirror) -> None:
        self._changed |= mirror.table.drain_changed()
        self._changed.update(w for r in mirror.table.reservations() for w in r.worker_ids)
        self._changed.update(mirror.table.recent_worker_ids())
        del self.by_id[mirror.replica_id]
        self.num_frees += 1

    # -- Releases through another replica, hand-offs ----------------------------------------------

    def owner_of(self, request_id: str) -> Mirror | None:
        """The mirror holding ``request_id``'s reservation, if any."""
        return next((m for m in self.by_id.values() if m.table.get(request_id) is not None), None)

    def ended_elsewhere(self, owner: Mirror, request_id: str) -> None:
        """``request_id`` of ``owner`` was released through another replica: its request ended, so it
        stops counting here at once (the owner's own release, when it comes, finds nothing more to
        do; an owner that died never sends one)."""
        if owner.table.end(request_id) is not None:
            self.num_frees += 1
            self._notify()

    def take_forwarded(self) -> list[str]:
        forwarded, self._forwarded = self._forwarded, []
        return forwarded

    def take_handoffs(self) -> list[HandOff]:
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    # -- the other replicas, as the scheduler reads them ---------------------------------------

    def others_tokens(self, worker_id: str) -> int:
        return sum(m.table.num_tokens_in_flight(worker_id) for m in self.by_id.values())

    def others_young_tokens(self, worker_id: str) -> int:
        return sum(m.table.token_snapshot()[1].get(worker_id, 0) for m in self.by_id.values())

    def others_in_flight(self, worker_id: str) -> int:
        return sum(m.table.num_in_flight(worker_id) for m in self.by_id.values())

    def others_recent_tokens(self, worker_id: str) -> float:
        return sum(m.table.recent_tokens(worker_id) for m in self.by_id.values())

    def others_in_flight_for_tenant(self, tenant: str) -> int:
        return sum(m.table.num_in_flight_for_tenant(tenant) for m in self.by_id.values())

    def drain_changed(self) -> set[str]:
        changed = self._changed
        for mirror in self.by_id.values():
            changed |= mirror.table.drain_changed()
        self._changed = set()
        return changed

    @property
    def has_remote_waiters(self) -> bool:
        return any(m.waiters for m in self.by_id.values())

    def remote_waiters(self) -> Iterator[RemoteWaiter]:
        for mirror in self.by_id.values():
            yield from mirror.waiters.values()

    def remote_heads(self, skip: Callable[[str], bool]) -> Iterator[RemoteWaiter]:
        """Per other replica and (class, tenant), its longest-waiting request for which ``skip`` is
        false: the only ones that can rank first (a replica's waiters of one tenant and class are in
        the order they were queued), without a pass over every waiter."""
        for mirror in self.by_id.values():
            for group in mirror.groups.values():
                for waiter in group.values():
                    if not skip(waiter.request_id):
                        yield waiter
                        break

    @property
    def num_live(self) -> int:
        return sum(1 for m in self.by_id.values() if not m.dead)
