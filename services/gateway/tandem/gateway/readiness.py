"""Readiness: can this gateway serve a request right now?

Called by the ``/readyz`` handler; calls the router (a gRPC connection
attempt) and the worker registry in Redis (:class:`tandem.common.registry.WorkerRegistry`).
Ready means this gateway can take requests: the router is reachable and the
registry answers. Workers are not required: a pool may be at zero
(``minReplicas: 0``), and then its requests are answered 503 with Retry-After
while the autoscaler starts it; a gateway that went NotReady instead would take
every model's traffic off the Service, the requests that raise the pool's
pending demand included. The worker counts are still reported in the body.
Answers are cached for a short time so that frequent probes from several
kubelets do not hammer Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import grpc

from tandem.common.errors import BackendUnavailableError
from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.common.tls import TLSSettings, aio_channel


@dataclass(frozen=True)
class ReadinessReport:
    ready: bool
    router_reachable: bool
    num_prefill_workers: int
    num_decode_workers: int
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReadinessCheck(Protocol):
    async def check(self) -> ReadinessReport: ...


class RouterProbe(Protocol):
    async def reachable(self) -> bool: ...


class WorkerLister(Protocol):
    """The part of :class:`~tandem.common.registry.WorkerRegistry` readiness needs."""

    async def list_workers(self, *, role: str | None = None, model: str | None = None) -> list[WorkerRecord]: ...


class GrpcConnectProbe:
    """The router is reachable when an HTTP/2 connection to it comes up within the timeout.

    A fresh channel per probe: a long-lived channel in reconnect backoff would
    report a router that came back as unreachable for up to two minutes.
    """

    def __init__(self, address: str, *, timeout_s: float, tls: TLSSettings | None = None) -> None:
        self._address = address
        self._timeout_s = timeout_s
        #: With TLS on the connection comes up only once the handshake (both certificates) passed.
        self._tls = tls if tls is not None else TLSSettings()

    async def reachable(self) -> bool:
        channel = aio_channel(self._address, self._tls)
        try:
            await asyncio.wait_for(channel.channel_ready(), self._timeout_s)
            return True
        except (TimeoutError, grpc.aio.AioRpcError):
            return False
        finally:
            await channel.close()


class RouterAndWorkersReadiness:
    """Router reachable and the worker registry readable (its counts reported, not required); cached ``cache_s``."""

    def __init__(
        self,
        router: RouterProbe,
        registry: WorkerLister,
        *,
        cache_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._router = router
        self._registry = registry
        self._cache_s = cache_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._cached: tuple[float, ReadinessReport] | None = None
        self._lock = asyncio.Lock()

    async def check(self) -> ReadinessReport:
        async with self._lock:  # one probe in flight; concurrent callers share its answer
            if self._cached is not None and self._clock() - self._cached[0] < self._cache_s:
                return self._cached[1]
            report = await self._probe()
            self._cached = (self._clock(), report)
            return report

    async def _probe(self) -> ReadinessReport:
        router_ok, workers = await asyncio.gather(self._router.reachable(), self._list_workers())
        if isinstance(workers, str):
            return ReadinessReport(False, router_ok, 0, 0, detail=workers)
        num_prefill = sum(1 for w in workers if w.role == ROLE_PREFILL)
        num_decode = sum(1 for w in workers if w.role == ROLE_DECODE)
        # Pools at zero are not this gateway's fault: said in the detail, not in ``ready``.
        notes = [
            what
            for what, ok in (("no prefill worker", num_prefill > 0), ("no decode worker", num_decode > 0))
            if not ok
        ]
        detail = "; ".join(["router unreachable", *notes] if not router_ok else notes)
        return ReadinessReport(router_ok, router_ok, num_prefill, num_decode, detail=detail)

    async def _list_workers(self) -> list[WorkerRecord] | str:
        try:
            return await asyncio.wait_for(self._registry.list_workers(), self._timeout_s)
        except (BackendUnavailableError, TimeoutError, ValueError) as exc:  # ValueError: a corrupt record
            return f"worker registry unreachable: {exc or 'timeout'}"
