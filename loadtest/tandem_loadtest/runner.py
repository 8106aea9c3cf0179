"""Runs a load test: schedules arrivals, sends requests, collects records.

Called by the CLI and by tests (with an httpx transport to fake the server);
calls :mod:`tandem_loadtest.client` for each request.

Bounds: the run stops issuing when ``num_requests`` have been issued or
``duration_s`` has passed, whichever comes first; requests in flight then
finish (each bounded by ``request_timeout_s``). ``max_concurrency`` caps
requests in flight for the open-loop modes, as ``vllm bench serve`` does; a
request's clock starts when it is actually sent.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from tandem_loadtest.arrivals import ArrivalProcess, FixedConcurrency
from tandem_loadtest.client import build_body, send_request
from tandem_loadtest.records import RequestRecord
from tandem_loadtest.tenants import Tenant, TenantConfig
from tandem_loadtest.workloads import WorkloadOptions

ProgressFn = Callable[[RequestRecord, Counter[str]], None]


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    model: str
    arrival: ArrivalProcess
    tenants: list[TenantConfig]
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    num_requests: int | None = 100
    duration_s: float | None = None
    max_concurrency: int | None = None
    cancel_fraction: float = 0.0
    cancel_after_s: float = 1.0
    request_timeout_s: float = 600.0
    ignore_eos: bool = False
    temperature: float | None = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("bound the run with num_requests, duration_s or both")
        if not self.tenants:
            raise ValueError("at least one tenant")

    def describe(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "arrival": self.arrival.describe(),
            "tenants": [
                {"name": t.name, "mix": t.mix, "share": t.share, "has_key": bool(t.api_key)} for t in self.tenants
            ],
            "workload": {k: str(v) for k, v in vars(self.workload).items()},
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "max_concurrency": self.max_concurrency,
            "cancel_fraction": self.cancel_fraction,
            "cancel_after_s": self.cancel_after_s,
            "request_timeout_s": self.request_timeout_s,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "seed": self.seed,
        }


@dataclass
class RunResult:
    config: dict[str, Any]
    records: list[RequestRecord]
    #: Wall time from the first send to the end of the last request, as vllm bench's "duration".
    duration_s: float
    started_unix_s: float


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class _Run:
    def __init__(self, config: RunConfig, client: httpx.AsyncClient, progress: ProgressFn | None) -> None:
        self.config = config
        self.client = client
        self.progress = progress
        self.rng = np.random.default_rng(config.seed)
        self.tenants = [Tenant.build(t, config.workload) for t in config.tenants]
        shares = np.array([t.share for t in config.tenants], dtype=float)
        self.tenant_p = shares / shares.sum()
        self.records: list[RequestRecord] = []
        self.counts: Counter[str] = Counter()
        self.start = 0.0
        self.semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    def _may_issue(self) -> bool:
        c = self.config
        if c.num_requests is not None and len(self.records) >= c.num_requests:
            return False
        return c.duration_s is None or time.perf_counter() - self.start < c.duration_s

    async def _one(self) -> None:
        """Pick a tenant and a request, send it, record it. Skips if no workload can issue."""
        tenant = self.tenants[int(self.rng.choice(len(self.tenants), p=self.tenant_p))]
        picked = tenant.next_request(self.rng)
        if picked is None:
            self.counts["skipped"] += 1
            return
        workload, spec = picked
        c = self.config
        cancel = c.cancel_fraction > 0 and bool(self.rng.random() < c.cancel_fraction)
        record = RequestRecord(
            index=len(self.records),
            tenant=tenant.config.name,
            label=spec.label,
            endpoint=spec.endpoint,
            max_tokens=spec.max_tokens,
            send_s=0.0,
            session_id=spec.session_id,
            cancel_after_s=c.cancel_after_s if cancel else None,
        )
        self.records.append(record)
        body = build_body(spec, c.model, ignore_eos=c.ignore_eos, temperature=c.temperature)
        if self.semaphore is not None:
            async with self.semaphore:
                text = await self._send(record, body, tenant.config.api_key)
        else:
            text = await self._send(record, body, tenant.config.api_key)
        workload.on_complete(spec, text, record.status == "ok")
        self.counts[record.status] += 1
        if self.progress is not None:
            self.progress(record, self.counts)

    async def _send(self, record: RequestRecord, body: dict[str, Any], api_key: str | None) -> str:
        record.send_s = time.perf_counter() - self.start
        return await send_request(self.client, record, body, api_key=api_key)

    async def open_loop(self, arrival: ArrivalProcess) -> None:
        tasks: set[asyncio.Task[None]] = set()
        for send_at_s in arrival.send_times_s(self.rng):
            if not self._may_issue():
                break
            delay = self.start + send_at_s - time.perf_counter()
            if self.config.duration_s is not None and send_at_s >= self.config.duration_s:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(0)  # let the task create its record before the bound is checked
        if tasks:
            await asyncio.gather(*tasks)

    async def closed_loop(self, concurrency: int) -> None:
        async def user() -> None:
            while self._may_issue():
                before = len(self.records)
                await self._one()
                if len(self.records) == before:  # nothing to send (all chat sessions busy): wait a bit
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(user() for _ in range(concurrency)))

    async def run(self) -> RunResult:
        started_unix = time.time()
        self.start = time.perf_counter()
        if isinstance(self.config.arrival, FixedConcurrency):
            await self.closed_loop(self.config.arrival.concurrency)
        else:
            await self.open_loop(self.config.arrival)
        ends = [r.send_s + r.end_s for r in self.records if r.end_s is not None]
        first = min((r.send_s for r in self.records), default=0.0)
        duration = max(ends, default=first) - first
        return RunResult(self.config.describe(), self.records, duration, started_unix)


async def run_load(
    config: RunConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: ProgressFn | None = None,
) -> RunResult:
    """Run the load test described by ``config``; ``transport`` replaces the network (tests)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(
        base_url=normalize_base_url(config.base_url), timeout=timeout, limits=limits, transport=transport
    ) as client:
        return await _Run(config, client, progress).run()
