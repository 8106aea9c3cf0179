"""In-flight reservations of one router replica, as leases.

:class:`tandem.router.scheduler.Scheduler` calls :meth:`ReservationTable.reserve`
on Schedule and :meth:`ReservationTable.release` on Release, and
:meth:`ReservationTable.sweep` before each of them, so a reservation whose
caller crashed stops counting after ``lease_s``. The policies read the table
through :meth:`ReservationTable.num_in_flight`. Pure bookkeeping: no I/O, the
clock is injected.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Reservation:
    """One request's hold on its workers until released or expired."""

    request_id: str
    worker_ids: tuple[str, ...]
    expires_at_s: float


class ReservationTable:
    """Reservations by request id, with per-worker in-flight counts."""

    def __init__(self, *, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self._lease_s = lease_s
        self._clock = clock
        self._by_request_id: dict[str, Reservation] = {}
        self._num_in_flight: Counter[str] = Counter()
        # (expires_at_s, request_id); may hold stale entries of released or
        # replaced reservations, which sweep() recognises and skips.
        self._expiry_heap: list[tuple[float, str]] = []

    @property
    def lease_s(self) -> float:
        return self._lease_s

    def __len__(self) -> int:
        return len(self._by_request_id)

    def num_in_flight(self, worker_id: str) -> int:
        return self._num_in_flight.get(worker_id, 0)

    def in_flight_by_worker(self) -> dict[str, int]:
        """Workers with at least one reservation and their counts."""
        return {w: n for w, n in self._num_in_flight.items() if n > 0}

    def reserve(self, request_id: str, worker_ids: tuple[str, ...]) -> Reservation:
        """Hold ``worker_ids`` for ``request_id``; a second Schedule of the same
        request (a retry elsewhere) replaces its earlier reservation."""
        self.release(request_id)
        reservation = Reservation(request_id, worker_ids, self._clock() + self._lease_s)
        self._by_request_id[request_id] = reservation
        self._num_in_flight.update(worker_ids)
        heapq.heappush(self._expiry_heap, (reservation.expires_at_s, request_id))
        return reservation

    def release(self, request_id: str) -> Reservation | None:
        """Drop ``request_id``'s reservation; None when there is none (idempotent)."""
        reservation = self._by_request_id.pop(request_id, None)
        if reservation is not None:
            self._num_in_flight.subtract(reservation.worker_ids)
            for worker_id in reservation.worker_ids:
                if self._num_in_flight[worker_id] <= 0:
                    del self._num_in_flight[worker_id]
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
                self.release(request_id)
                expired.append(current)
        return expired
