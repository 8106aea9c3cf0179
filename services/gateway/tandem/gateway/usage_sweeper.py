"""Keeps this gateway replica's open usage records alive, and settles those of dead replicas.

Started and stopped by :func:`tandem.gateway.app.build_app`'s lifespan; calls
:class:`tandem.gateway.usage.UsageStore`. Every ``liveness_s / 3`` it renews
this replica's liveness key (TTL ``liveness_s``) and, every ``sweep_interval_s``,
settles the open records of replicas whose key expired: a gateway SIGKILLed
mid-stream (OOM kill, node loss) has its requests billed with the tokens its
records last held, within ``liveness_s + sweep_interval_s`` of its death, by
any live replica (its own successor included: a restart is a new replica).
It also frees their tenants' concurrency slots (a killed gateway held its
tenant's slot until the quota lease ran out, ~630 s) and ends their router
reservations (both idempotent), so that a dead replica's requests hold neither
a tenant's streams nor prefill and decode budget until their leases run out. A
Redis outage only delays all of it; the loop keeps going.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from tandem.common.errors import BackendUnavailableError
from tandem.gateway.usage import Orphan, UsageStore

logger = logging.getLogger(__name__)


class UsageSweeper:
    def __init__(
        self,
        store: UsageStore,
        *,
        liveness_s: float,
        sweep_interval_s: float,
        end_reservation: Callable[[str], Awaitable[object]] | None = None,
        free_slot: Callable[[str, str, str], Awaitable[object]] | None = None,
    ) -> None:
        if not store.replica_id:
            raise ValueError("the usage store needs this replica's id")
        self._store = store
        self._liveness_s = liveness_s
        self._renew_s = liveness_s / 3
        self._sweep_interval_s = sweep_interval_s
        #: Ends a dead replica's router reservation (idempotent), so that its budget is not held until
        #: the lease runs out.
        self._end_reservation = end_reservation
        #: Frees a dead replica's request's concurrency slot of its tenant (and of its model, if the tenant
        #: limits that model): ``(tenant_id, request_id, model)``.
        self._free_slot = free_slot
        self._task: asyncio.Task[None] | None = None
        # A stop signal rather than only cancellation: redis-py may absorb a CancelledError that
        # arrives mid-command (seen: the loop went on for another round).
        self._stopping = asyncio.Event()
        #: Open records of dead replicas settled by this one (for logs and tests).
        self.num_settled = 0

    async def run(self) -> None:
        next_sweep_s = time.monotonic()  # at once: a restarted gateway settles its predecessor's records
        while not self._stopping.is_set():
            try:
                await self._store.renew_liveness(self._liveness_s)
                if time.monotonic() >= next_sweep_s:
                    next_sweep_s = time.monotonic() + self._sweep_interval_s
                    orphans = await self._store.settle_orphans()
                    self.num_settled += len(orphans)
                    for orphan in orphans:
                        await self._free(orphan)
            except BackendUnavailableError as exc:
                logger.warning("usage liveness or sweep skipped: %s", exc)
            except Exception:
                logger.exception("usage sweep failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), min(self._renew_s, self._sweep_interval_s))

    async def _free(self, orphan: Orphan) -> None:
        if self._free_slot is not None and orphan.tenant_id:
            try:
                await self._free_slot(orphan.tenant_id, orphan.request_id, orphan.model)
            except Exception as exc:  # its lease frees it anyway
                logger.warning("quota slot of a dead replica's request not freed: %s", exc)
        if self._end_reservation is not None:
            try:
                await self._end_reservation(orphan.request_id)
            except Exception as exc:  # its lease ends it anyway
                logger.warning("router reservation of a dead replica's request not ended: %s", exc)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="usage-sweeper")

    async def stop(self) -> None:
        """Stop renewing; the replica's liveness key is deleted, so that its leftovers (none after a
        drain) are settled at once."""
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(BackendUnavailableError):
            await self._store.drop_liveness()
