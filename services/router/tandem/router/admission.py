"""The admission queue: requests wait here while no worker has budget.

:class:`tandem.router.scheduler.Scheduler` puts a request in with
:meth:`AdmissionQueue.push` when placement finds no budget, and, whenever
budget may have come free (a release, an expired lease, a fresh registry
read, a poll), asks :meth:`AdmissionQueue.next` which waiter to try first:

* priority classes strictly in order (``priority_classes``, highest first);
* within a class, per-tenant fair share in uncached prompt tokens: the tenant
  the whole router served least lately (:class:`tandem.router.fair_share.TenantShares`,
  every replica's placements counted) goes first, then the one waiting
  longest; so a tenant with a burst of long prompts cannot starve one with a
  few short ones, whichever replicas their requests reach;
* within a tenant, first in, first out.

:meth:`AdmissionQueue.rank` is the order as a sortable key, so that the
scheduler can compare its head with the other replicas' waiting requests
(:mod:`tandem.router.ledger`) and let a better one go first.

A waiter whose timeout passes is removed and answered "no capacity" with a
Retry-After, which the gateway turns into a 503. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class Waiter(Generic[T]):
    """One queued request; ``future`` gets the placement (or an error)."""

    item: T
    tenant: str
    priority: str
    enqueued_at_s: float
    future: asyncio.Future[object] = field(repr=False)
    #: Wall-clock enqueue time: comparable with the other replicas' waiters.
    enqueued_at_unix: float = 0.0


class QueueFullError(Exception):
    pass


class AdmissionQueue(Generic[T]):
    def __init__(
        self,
        *,
        priority_classes: Sequence[str],
        default_priority: str,
        max_depth: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if default_priority not in priority_classes:
            raise ValueError(f"default priority {default_priority!r} is not one of {list(priority_classes)}")
        self._classes = list(priority_classes)
        self._default = default_priority
        self._max_depth = max_depth
        self._clock = clock
        self._wall = wall_clock
        # priority → tenant → FIFO of waiters
        self._queues: dict[str, dict[str, deque[Waiter[T]]]] = {p: {} for p in self._classes}
        self._depth = 0

    @property
    def priority_classes(self) -> list[str]:
        return list(self._classes)

    def priority_index(self, priority: str) -> int:
        """0 for the highest class."""
        return self._classes.index(priority)

    def priority_of(self, requested: str) -> str:
        """A known priority class for ``requested``: a class name, or a number
        where larger is served first and 1 is the lowest class (the gateway's
        tenant priority); "", 0 or unknown: the default."""
        if requested in self._queues:
            return requested
        if requested.isdigit() and 1 <= int(requested) <= len(self._classes):
            return self._classes[len(self._classes) - int(requested)]
        return self._default

    def __len__(self) -> int:
        return self._depth

    def depth(self, priority: str) -> int:
        return sum(len(q) for q in self._queues.get(priority, {}).values())

    def waiters(self) -> Iterator[Waiter[T]]:
        """Every waiter, in no particular order."""
        for tenants in self._queues.values():
            for fifo in tenants.values():
                yield from fifo

    def push(self, item: T, *, tenant: str, priority: str) -> Waiter[T]:
        if self._depth >= self._max_depth:
            raise QueueFullError(f"admission queue full ({self._max_depth} waiting)")
        waiter: Waiter[T] = Waiter(
            item,
            tenant,
            self.priority_of(priority),
            self._clock(),
            asyncio.get_running_loop().create_future(),
            self._wall(),
        )
        self._queues[waiter.priority].setdefault(tenant, deque()).append(waiter)
        self._depth += 1
        return waiter

    def rank(self, priority_index: int, service: float, enqueued_at_unix: float) -> tuple[int, float, float]:
        """The admission order as a key (smaller goes first): class, the tenant's service, age."""
        return (priority_index, service, enqueued_at_unix)

    def next(self, service: Callable[[str], float]) -> Waiter[T] | None:
        """The waiter to try first (it stays queued until :meth:`remove`); ``service`` gives each
        tenant's recent service (uncached prompt tokens over its weight)."""
        for priority in self._classes:
            tenants = self._queues[priority]
            if not tenants:
                continue
            tenant = min(tenants, key=lambda t: (service(t), tenants[t][0].enqueued_at_unix))
            return tenants[tenant][0]
        return None

    def remove(self, waiter: Waiter[T]) -> bool:
        """Take ``waiter`` out (admitted or timed out); False when it was not queued."""
        tenants = self._queues[waiter.priority]
        fifo = tenants.get(waiter.tenant)
        if fifo is None:
            return False
        try:
            fifo.remove(waiter)
        except ValueError:
            return False
        if not fifo:
            del tenants[waiter.tenant]
        self._depth -= 1
        return True
