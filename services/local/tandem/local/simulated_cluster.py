"""A SIMULATED cluster: many :class:`~tandem.local.simulated_servicer.SimulatedWorker` in one
process, registered in the Redis worker registry with a heartbeat, started, scaled and stopped together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from tandem.common.registry import WorkerRegistry
from tandem.local.simulated_servicer import SimulatedWorker, SimulatedWorkerConfig

# The logger these heartbeats always logged to (before the cluster left simulated_worker.py).
logger = logging.getLogger("tandem.local.simulated_worker")


class SimulatedCluster:
    """Many SIMULATED workers in one process, registered in Redis under ``key_prefix``."""

    def __init__(
        self,
        configs: Sequence[SimulatedWorkerConfig],
        *,
        redis_url: str,
        key_prefix: str,
        heartbeat_interval_s: float = 0.5,
        ttl_s: float = 3.0,
    ) -> None:
        self.workers = [SimulatedWorker(c) for c in configs]
        self.key_prefix = key_prefix
        self._registry = WorkerRegistry(redis_url, key_prefix=key_prefix, ttl_s=ttl_s)
        self._interval_s = heartbeat_interval_s
        self._heartbeat: asyncio.Task[None] | None = None
        # redis-py can swallow a CancelledError that lands inside a command (the heartbeat then went on
        # beating and aclose() waited for it forever, ~1 run in 10 of the 64-worker test): it stops on this too.
        self._closed = False
        self._started_unix_s: dict[str, float] = {}

    async def start(self) -> None:
        for worker in self.workers:
            await worker.start()
            self._started_unix_s[worker.config.worker_id] = time.time()
        await self.heartbeat_once()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat_forever())

    async def heartbeat_once(self) -> None:
        for worker in list(self.workers):  # workers come and go while a heartbeat awaits Redis
            if worker not in self.workers:
                continue
            record = replace(worker.record(), started_unix_s=self._started_unix_s[worker.config.worker_id])
            await self._registry.heartbeat(record)

    async def _beat_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._interval_s)
            try:
                await self.heartbeat_once()
            except Exception:
                logger.exception("simulated heartbeat failed")

    async def add_worker(self, config: SimulatedWorkerConfig) -> SimulatedWorker:
        """Start one more worker; it is registered at once (a scale-up whose engine is ready)."""
        worker = SimulatedWorker(config)
        await worker.start()
        self._started_unix_s[config.worker_id] = time.time()
        self.workers.append(worker)
        await self._registry.heartbeat(replace(worker.record(), started_unix_s=self._started_unix_s[config.worker_id]))
        return worker

    async def drain_worker(self, worker: SimulatedWorker, timeout_s: float = 60.0) -> None:
        """Unregister ``worker`` (no new requests), let its requests finish, then close it: what a real
        worker does on SIGTERM."""
        self.workers.remove(worker)
        await self._registry.unregister(worker.config.worker_id)
        deadline = time.monotonic() + timeout_s
        while worker.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await worker.aclose()

    async def stop_worker(self, worker: SimulatedWorker) -> None:
        """Take one worker away (unregister and close), like a worker that was drained."""
        self.workers.remove(worker)
        await self._registry.unregister(worker.config.worker_id)
        await worker.aclose()

    async def aclose(self) -> None:
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        for worker in self.workers:
            with contextlib.suppress(Exception):
                await self._registry.unregister(worker.config.worker_id)
            await worker.aclose()
        await self._registry.aclose()
