from __future__ import annotations

import pytest

from tandem.router.reservations import ReservationTable
from tests.kit.clock import FakeClock


def test_reserve_counts_each_worker_and_release_frees_them() -> None:
    table = ReservationTable(lease_s=10, clock=FakeClock())
    table.reserve("r1", ("p0", "d0"))
    table.reserve("r2", ("p0", "d1"))
    assert (table.num_in_flight("p0"), table.num_in_flight("d0"), table.num_in_flight("d1")) == (2, 1, 1)
    released = table.end("r1")
    assert released is not None and released.worker_ids == ("p0", "d0")
    assert table.in_flight_by_worker() == {"p0": 1, "d1": 1}
    assert len(table) == 1


def test_release_is_idempotent() -> None:
    table = ReservationTable(lease_s=10, clock=FakeClock())
    table.reserve("r1", ("p0", "d0"))
    assert table.end("r1") is not None
    assert table.end("r1") is None
    assert table.end("never-scheduled") is None
    assert table.num_in_flight("p0") == 0


def test_rescheduling_a_request_replaces_its_reservation() -> None:
    table = ReservationTable(lease_s=10, clock=FakeClock())
    table.reserve("r1", ("p0", "d0"))
    table.reserve("r1", ("p1", "d0"))
    assert table.in_flight_by_worker() == {"p1": 1, "d0": 1}


def test_sweep_drops_only_expired_leases() -> None:
    clock = FakeClock()
    table = ReservationTable(lease_s=10, clock=clock)
    table.reserve("old", ("p0", "d0"))
    clock.advance(5)
    table.reserve("new", ("p1", "d1"))
    clock.advance(5)
    assert [r.request_id for r in table.sweep()] == ["old"]
    assert table.in_flight_by_worker() == {"p1": 1, "d1": 1}
    clock.advance(5)
    assert [r.request_id for r in table.sweep()] == ["new"]
    assert table.in_flight_by_worker() == {}


def test_sweep_ignores_released_and_replaced_reservations() -> None:
    clock = FakeClock()
    table = ReservationTable(lease_s=10, clock=clock)
    table.reserve("released", ("p0", "d0"))
    table.end("released")
    table.reserve("renewed", ("p0", "d0"))
    clock.advance(6)
    table.reserve("renewed", ("p1", "d1"))  # a retry: its lease starts again
    clock.advance(6)
    assert table.sweep() == []
    assert table.in_flight_by_worker() == {"p1": 1, "d1": 1}


def test_expiry_heap_stays_bounded_under_release_churn() -> None:
    table = ReservationTable(lease_s=600, clock=FakeClock())
    for i in range(20_000):
        table.reserve(f"r{i}", ("p0", "d0"))
        table.end(f"r{i}")
    assert len(table._expiry_heap) <= 2 * len(table) + 1025


def test_lease_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ReservationTable(lease_s=0)
