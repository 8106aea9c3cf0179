"""In-flight reservations of one router replica, as leases.

:class:`tandem.router.scheduler.Scheduler` calls :meth:`ReservationTable.reserve`
on Schedule and :meth:`ReservationTable.release` on Release, and
:meth:`ReservationTable.sweep` before each of them, so a reservation whose
caller crashed stops counting after ``lease_s``. The policies read the table
through :meth:`ReservationTable.num_in_flight` and
:meth:`ReservationTable.num_tokens_in_flight` (the token budget: uncached
prompt tokens on a prefill worker, prompt plus max_tokens on a decode worker).
Tokens reserved less than ``young_s`` ago are tracked apart, so the budget can
trust the workers' own reports for older ones (see :mod:`tandem.router.budget`).
Pure bookkeeping: no I/O, the clock is injected.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tandem.router.decay import decayed


@dataclass(frozen=True)
class Reservation:
    """One request's hold on its workers until released or expired."""

    request_id: str
    worker_ids: tuple[str, ...]
    expires_at_s: float
    #: Budget tokens held per worker.
    tokens_by_worker: Mapping[str, int] = field(default_factory=dict)
    tenant: str = ""
    reserved_at_s: float = 0.0


class ReservationTable:
    """Reservations by request id, with per-worker in-flight counts."""

    def __init__(
        self,
        *,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        young_s: float = 2.0,
        recent_half_life_s: float = 30.0,
    ) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self._lease_s = lease_s
        self._clock = clock
        self._young_s = young_s
        self._by_request_id: dict[str, Reservation] = {}
        self._num_in_flight: Counter[str] = Counter()
        self._num_tokens: Counter[str] = Counter()
        self._num_young_tokens: Counter[str] = Counter()
        self._num_by_tenant: Counter[str] = Counter()
        # (reserved_at_s, request_id) in reservation order, for aging young tokens;
        # _young_ids holds the requests whose tokens still count as young.
        self._young: deque[tuple[float, str]] = deque()
        self._young_ids: set[str] = set()
        # Budget tokens placed per worker, decayed with a half-life: how much work a
        # worker was given lately, even when none of it is in flight any more.
        self._recent_half_life_s = recent_half_life_s
        self._recent: dict[str, tuple[float, float]] = {}
        # (expires_at_s, request_id); may hold stale entries of released or
        # replaced reservations, which sweep() recognises and skips.
        self._expiry_heap: list[tuple[float, str]] = []
        # Workers whose counters changed since drain_changed() was last called.
        self._changed: set[str] = set()

    @property
    def lease_s(self) -> float:
        return self._lease_s

    def __len__(self) -> int:
        return len(self._by_request_id)

    def num_in_flight(self, worker_id: str) -> int:
        return self._num_in_flight.get(worker_id, 0)

    def num_tokens_in_flight(self, worker_id: str) -> int:
        """Budget tokens held on ``worker_id`` by live reservations."""
        return self._num_tokens.get(worker_id, 0)

    def token_snapshot(self) -> tuple[Mapping[str, int], Mapping[str, int]]:
        """(tokens, young tokens) per worker, read-only views valid until the next change
        (one decision reads them many times)."""
        self._age()
        return self._num_tokens, self._num_young_tokens

    def now_s(self) -> float:
        """The table's clock (the decisions that read it use the same time)."""
        return self._clock()

    @property
    def recent_half_life_s(self) -> float:
        return self._recent_half_life_s

    def recent_tokens(self, worker_id: str) -> float:
        """Budget tokens placed on ``worker_id`` lately (exponentially decayed)."""
        value, at_s = self._recent.get(worker_id, (0.0, 0.0))
        if not value:
            return 0.0
        return decayed(value, self._clock() - at_s, self._recent_half_life_s)

    def recent_tokens_at(self, worker_id: str) -> tuple[float, float]:
        """(recent tokens, as of this clock time): :meth:`recent_tokens` without the decay since then."""
        return self._recent.get(worker_id, (0.0, 0.0))

    def max_recent_tokens(self) -> float:
        """The largest :meth:`recent_tokens` of any worker (0 when nothing was placed lately)."""
        now_s = self._clock()
        return max(
            (decayed(value, now_s - at_s, self._recent_half_life_s) for value, at_s in self._recent.values()),
            default=0.0,
        )

    def recent_by_worker(self) -> dict[str, tuple[float, float]]:
        """Every worker's :meth:`recent_tokens_at` (a copy)."""
        return dict(self._recent)

    def set_recent_tokens(self, worker_id: str, value: float, at_s: float) -> None:
        """Replace ``worker_id``'s recent tokens with ``value`` as of ``at_s`` (this table's clock): a
        mirror rebuilt from another replica's snapshot learns the work that replica placed lately,
        released reservations included (see :meth:`tandem.router.ledger.Ledger.apply_snapshot`)."""
        self._recent[worker_id] = (float(value), float(at_s))
        self._changed.add(worker_id)

    def recent_worker_ids(self) -> set[str]:
        """Workers with tokens placed on them at some time (see :meth:`recent_tokens`)."""
        return set(self._recent)

    def drain_changed(self) -> set[str]:
        """Workers whose tokens, young tokens, requests or recent tokens changed since the last call."""
        self._age()
        changed, self._changed = self._changed, set()
        return changed

    def tokens_by_worker(self) -> dict[str, int]:
        return {w: n for w, n in self._num_tokens.items() if n > 0}

    def young_tokens_by_worker(self) -> dict[str, int]:
        self._age()
        return {w: n for w, n in self._num_young_tokens.items() if n > 0}

    def num_in_flight_for_tenant(self, tenant: str) -> int:
        return self._num_by_tenant.get(tenant, 0)

    def _age(self) -> None:
        horizon_s = self._clock() - self._young_s
        while self._young and self._young[0][0] <= horizon_s:
            reserved_at_s, request_id = self._young.popleft()
            current = self._by_request_id.get(request_id)
            if current is not None and current.reserved_at_s == reserved_at_s and request_id in self._young_ids:
                self._young_ids.discard(request_id)
                self._num_young_tokens.subtract(current.tokens_by_worker)
                self._changed.update(current.tokens_by_worker)

    def in_flight_by_worker(self) -> dict[str, int]:
        """Workers with at least one reservation and their counts."""
        return {w: n for w, n in self._num_in_flight.items() if n > 0}

    def reserve(
        self,
        request_id: str,
        worker_ids: tuple[str, ...],
        tokens_by_worker: Mapping[str, int] | None = None,
        *,
        tenant: str = "",
        reserved_at_s: float | None = None,
    ) -> Reservation:
        """Hold ``worker_ids`` (and their budget tokens) for ``request_id``; a
        second Schedule of the same request (a retry elsewhere) replaces its
        earlier reservation. ``reserved_at_s`` (this table's clock) backdates it:
        a mirror of another replica's reservation made a moment ago."""
        self.end(request_id)
        self._age()
        now_s = self._clock() if reserved_at_s is None else reserved_at_s
        tokens = {w: n for w, n in (tokens_by_worker or {}).items() if n > 0}
        reservation = Reservation(request_id, worker_ids, now_s + self._lease_s, tokens, tenant, now_s)
        self._by_request_id[request_id] = reservation
        self._num_in_flight.update(worker_ids)
        self._num_tokens.update(tokens)
        self._num_young_tokens.update(tokens)
        for worker_id, n in tokens.items():
            value, at_s = self._recent.get(worker_id, (0.0, now_s))
            self._recent[worker_id] = (decayed(value, now_s - at_s, self._recent_half_life_s) + n, now_s)
        self._num_by_tenant[tenant] += 1
        self._changed.update(worker_ids)
        self._young.append((now_s, request_id))
        self._young_ids.add(request_id)
        heapq.heappush(self._expiry_heap, (reservation.expires_at_s, request_id))
        return reservation

    def get(self, request_id: str) -> Reservation | None:
        return self._by_request_id.get(request_id)

    def reservations(self) -> list[Reservation]:
        """Every live reservation (snapshots for the other replicas)."""
        return list(self._by_request_id.values())

    def end(self, request_id: str) -> Reservation | None:
        """Drop ``request_id``'s reservation; None when there is none (idempotent)."""
        self._age()
        reservation = self._by_request_id.pop(request_id, None)
        if reservation is not None:
            self._num_in_flight.subtract(reservation.worker_ids)
            for worker_id in reservation.worker_ids:
                if self._num_in_flight[worker_id] <= 0:
                    del self._num_in_flight[worker_id]
            self._num_tokens.subtract(reservation.tokens_by_worker)
            if request_id in self._young_ids:
                self._young_ids.discard(request_id)
                self._num_young_tokens.subtract(reservation.tokens_by_worker)
            for worker_id in reservation.tokens_by_worker:
                if self._num_tokens[worker_id] <= 0:
                    del self._num_tokens[worker_id]
                if self._num_young_tokens.get(worker_id, 0) <= 0:
                    self._num_young_tokens.pop(worker_id, None)
            self._num_by_tenant[reservation.tenant] -= 1
            if self._num_by_tenant[reservation.tenant] <= 0:
                del self._num_by_tenant[reservation.tenant]
            self._changed.update(reservation.worker_ids)
            self._maybe_compact()
        return reservation

    def _maybe_compact(self) -> None:
        # Released entries stay in the heap until their expiry; with a long
        # lease and a high request rate they would pile up, so rebuild it
        # from the live reservations once they dominate.
        if len(self._expiry_heap) > 2 * len(self._by_request_id) + 1024:
            self._expiry_heap = [(r.expires_at_s, r.request_id) for r in self._by_request_id.values()]
            heapq.heapify(self._expiry_heap)

    def sweep(self) -> list[Reservation]:
        """Drop and return the reservations whose lease has run out."""
        now_s = self._clock()
        expired: list[Reservation] = []
        while self._expiry_heap and self._expiry_heap[0][0] <= now_s:
            expires_at_s, request_id = heapq.heappop(self._expiry_heap)
            current = self._by_request_id.get(request_id)
            if current is not None and current.expires_at_s == expires_at_s:
                self.end(request_id)
                expired.append(current)
        return expired
