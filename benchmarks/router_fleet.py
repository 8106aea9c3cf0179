"""The router at fleet scale (``make bench-router``'s fleet phase; alone: ``python
benchmarks/router_fleet.py``). SIMULATED workers, the real router pieces; every figure here is
the router's, never model speed.

(1) **Speed.** ``--workers`` (1,000) SIMULATED workers, 3/4 prefill, in a process of their own
    (:mod:`tandem.local.simulated_fleet`; pinned to the other cores than this process's one,
    ``--no-pin`` shares them): registered in the real Redis, each publishing KV events
    over ZMQ in vLLM's wire format. This process runs one router replica as the Serve deployment
    does: the scheduler, the KV-event subscriber following every worker, the registry view
    refreshed in the background, the ledger. The index is filled to ``--entries`` (10 M)
    (worker, block) entries through the subscriber. Then schedules arrive open-loop (Poisson) at
    ``--rate`` per second for ``--seconds``; each placement makes its worker store the prompt's
    blocks (live KV events back into the index), and each request is released after a simulated
    0.5-2 s. Prompts carry the gateway's block hashes (16-token blocks): a tenant's system prompt
    and one of its documents (32 + 96 blocks, cached on 1-3 workers), then 4 new blocks.
    Reported: schedule latency p50/p99 from each request's arrival (waiting behind event
    ingestion, releases and the other schedules included), the decision's own CPU time, and the
    index's bytes per (worker, block) entry. How requests arrive (``--arrivals``): by default a
    driver process (benchmarks/fleet_arrivals.py, on the fleet's core) sends each one over a Unix
    datagram socket at its own arrival time, as a client's request reaches a replica over the network;
    the loop wakes at once, and latency counts from the arrival time, the driver's lateness included
    (p50 0.03 ms, p99 0.2 ms on a loaded host). ``--arrivals loop`` (the driver before 2026-12-06, whose
    figures the history in services/router/README.md holds) is a coroutine in the replica's loop whose
    sleeps wake on the millisecond (epoll's timeout is rounded up): it hands over each millisecond's
    arrivals together and they queue behind each other (14 % of them within 0.1 ms of the one before,
    against 2.5 % for Poisson arrivals at 250/s), a pessimistic p99. ``--arrivals thread`` hands them
    over from a thread of the replica's process, which must take the GIL from the loop to do it (p99
    3-4 ms late on a shared host). All three log the share of bursts. With the socket driver, the
    slowest 1 %'s waits are also split by the kernel's account of the loop thread (its ``schedstat``,
    read by the driver right after each send and by the loop when the request first runs): on the
    CPU (the loop's other work), runnable but waiting for its core, and neither. The kernel updates
    a running thread's figures at ticks and switches, so each part is approximate (the third can
    read negative); their sums over the slowest 1 % say which dominates.

(2) **One view across active replicas.** A smaller SIMULATED fleet (``--replica-workers``, 128)
    and four router replicas in this process, each with its own subscriber, index, registry view
    and ledger (they share nothing but Redis and the workers' KV-event streams), and a fifth, the
    *oracle*: a single replica that follows the same streams and sees every replica's
    reservations the moment they are made. A multi-tenant trace is replayed at ``--replica-rate``;
    each request goes to a replica by rendezvous hashing of its id (as Serve's consistent-hash
    router does); right before that replica places it, the oracle says where it would (a dry run).
    ``replica_agreement`` is the share of placements where both chose the same (prefill, decode)
    pair. The trace is replayed again on a fresh fleet with one replica killed halfway (its
    requests move to the others): ``hit_rate_loss_one_replica`` is the relative loss of the
    prefix-cache hit rate the SIMULATED workers' own caches saw. A third replay drops 1 % of the
    KV-event messages at each replica (independently); once the trace is over and the subscribers
    have caught up from the workers' replay sockets, ``index_divergence`` is the largest share of
    (worker, block) entries in which a replica's index differs from what the workers hold.

(3) **Token-fair tenants across replicas.** Four replicas with their ledgers over Redis, 48
    SIMULATED prefill workers in this process computing one prompt at a time (0.8 s for a
    2,048-token prompt: a time scale, not model speed), each worker's prefill budget one prompt.
    A victim tenant sends 2,048-token prompts at ``--victim-rate``; alone first, then beside a
    noisy tenant sending 10x as many. ``victim_ttft_p99_ratio`` = the victim's time to first
    token (Schedule + prefill) p99 with the neighbour over its p99 alone. Then four equal-weight
    tenants, all sending more than their share, with prompts of 512, 1,024, 2,048 and 4,096
    tokens, their requests spread over the four replicas: ``jain`` is Jain's index over the
    uncached prompt tokens each tenant was served (a request-fair queue would give ~0.66).

Ends with ``bench-router-fleet: schedule_p99_ms=… bytes_per_block=… replica_agreement=…
hit_rate_loss_one_replica=… victim_ttft_p99_ratio=… jain=…`` (and ``index_divergence=…``); a
part skipped with ``--skip-*`` leaves its fields ``nan``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import math
import os
import random
import socket
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tandem.common.errors import NoCapacityError
from tandem.local.simulated_fleet import FleetCorpus, FleetSpec, SimulatedFleet
from tandem.local.simulated_worker import SimulatedCluster, SimulatedLatencyModel, SimulatedWorkerConfig
from tandem.local.stack import free_port
from tandem.router.gc_tuning import tune_gc
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.router.ledger import Ledger
from tandem.router.policy import ScheduleRequest
from tandem.router.replica import KVEventDrops, LedgerIdentity, build_replica
from tandem.router.replica import Replica as RouterReplica
from tandem.router.scheduler import PlacementDecision, Scheduler
from tandem.router.settings import RouterConfig
from tandem.v1 import worker_pb2

REDIS_URL = "redis://127.0.0.1:6379/0"
#: The replicas' shared ledger secret (each message and snapshot carries an HMAC-SHA256 tag made with it).
LEDGER_SECRET = uuid.uuid4().bytes + uuid.uuid4().bytes
BLOCK_TOKENS = 16
HASH_SEED = "vllm-none-hash"
TAIL_BLOCKS = 4
#: prctl(2): this thread's timer slack, in ns.
_PR_SET_TIMERSLACK = 29


def log(msg: str) -> None:
    print(f"[bench-router-fleet] {msg}", flush=True)


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


async def delete_prefix(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        await client.delete(key)
    await client.aclose()


@dataclass
class Trace:
    """Requests of many tenants over the fleet corpus: (tenant, document) by a Zipf-like popularity."""

    corpus: FleetCorpus
    seed: int
    tenant_weights: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tenant_weights = [1.0 / (t + 1) ** 0.8 for t in range(self.corpus.num_tenants)]
        self._rnd = random.Random(self.seed)

    def request(self, request_id: str) -> tuple[ScheduleRequest, list[int]]:
        rnd = self._rnd
        tenant = rnd.choices(range(self.corpus.num_tenants), weights=self.tenant_weights)[0]
        doc = rnd.randrange(self.corpus.docs_per_tenant)
        hashes = self.corpus.prefix(tenant, doc) + [rnd.getrandbits(64) for _ in range(TAIL_BLOCKS)]
        num_tokens = len(hashes) * BLOCK_TOKENS + 7
        request = ScheduleRequest(
            request_id=request_id,
            model="simulated-model",
            num_prompt_tokens=num_tokens,
            max_tokens=128,
            tenant=f"tenant-{tenant}",
            prompt_block_hashes={(BLOCK_TOKENS, HASH_SEED): tuple(hashes)},
        )
        return request, hashes


@dataclass
class Replica:
    """One router replica as the Serve deployment builds it (:func:`build_replica`), without Serve."""

    parts: RouterReplica
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def scheduler(self) -> Scheduler:
        return self.parts.scheduler

    @property
    def subscriber(self) -> KVEventSubscriber:
        assert self.parts.subscriber is not None
        return self.parts.subscriber

    @property
    def ledger(self) -> Ledger:
        assert self.parts.ledger is not None
        return self.parts.ledger

    async def start(self) -> None:
        self.ledger.start()
        self.tasks.append(asyncio.get_running_loop().create_task(self._upkeep()))
        await self.scheduler.refresh_workers()

    async def _upkeep(self) -> None:
        # The deployment's _sync_forever: follow the registry and the forwarded Releases.
        while True:
            await asyncio.sleep(0.25)
            await self.scheduler.refresh_workers()
            await self.scheduler.sync_replicas()

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.parts.aclose()


def make_replica(
    key_prefix: str,
    name: str,
    *,
    drop_fraction: float = 0.0,
    drop_seed: int = 0,
    ledger_prefix: str | None = None,
    **config: object,
) -> Replica:
    """A replica with the router's defaults but for ``config`` (RouterConfig's fields, groups as dicts)."""
    settings = RouterConfig.model_validate(
        {
            "redis": {"url": REDIS_URL},
            "registry": {"key_prefix": key_prefix, "ttl_s": 10.0},
            # the ledger's snapshot round this benchmark's figures were measured with (the Ledger's default)
            "replica_sync_interval_s": 0.5,
            **config,
        }
    )
    return Replica(
        build_replica(
            settings,
            ledger=LedgerIdentity(name, LEDGER_SECRET, key_prefix=ledger_prefix),
            kv_event_drops=KVEventDrops(drop_fraction, drop_seed),
        )
    )


# -- (1) speed ---------------------------------------------------------------------------------


class LoopStalls:
    """``FLEET_STALLS=1``: every event-loop callback that ran over 0.2 ms (``FLEET_STALLS_MS``) during
    the open-loop phase, summed by what ran (a task's coroutine, or the callback), so a schedule's
    wait from its arrival can be traced to what held the loop (:meth:`waited_behind`), and how much of
    that time the process spent off the CPU (wall clock minus the thread's CPU time: the host ran
    something else). Costs ~3 us a callback."""

    _THRESHOLD_S = float(os.environ.get("FLEET_STALLS_MS", "0.2")) / 1e3

    def __init__(self) -> None:
        self._run = asyncio.events.Handle._run
        self.total_s: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.worst_s: dict[str, float] = {}
        self.off_cpu_s: dict[str, float] = {}
        #: (started, ended, name) of every callback over the threshold, to tell what a request waited behind
        self.timeline: list[tuple[float, float, str]] = []

    def start(self) -> LoopStalls:
        run, threshold_s = self._run, self._THRESHOLD_S

        def timed(handle: asyncio.events.Handle) -> None:
            started_s, started_cpu_s = time.perf_counter(), time.thread_time()
            run(handle)
            took_s = time.perf_counter() - started_s
            if took_s > threshold_s:
                name = self._name(handle)
                off_cpu_s = max(0.0, took_s - (time.thread_time() - started_cpu_s))
                self.off_cpu_s[name] = self.off_cpu_s.get(name, 0.0) + off_cpu_s
                self.total_s[name] = self.total_s.get(name, 0.0) + took_s
                self.count[name] = self.count.get(name, 0) + 1
                self.worst_s[name] = max(self.worst_s.get(name, 0.0), took_s)
                self.timeline.append((started_s, started_s + took_s, name))

        asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]
        return self

    def stop(self) -> None:
        asyncio.events.Handle._run = self._run  # type: ignore[method-assign]

    @staticmethod
    def _name(handle: asyncio.events.Handle) -> str:
        callback = handle._callback  # type: ignore[attr-defined]
        task = getattr(callback, "__self__", None)
        if isinstance(task, asyncio.Task):
            return f"task {getattr(task.get_coro(), '__qualname__', '?')}"
        return str(getattr(callback, "__qualname__", callback))[:80]

    def waited_behind(self, intervals: Sequence[tuple[float, float]]) -> None:
        """What ran while these requests waited (arrival, first step): callback time by name."""
        behind: dict[str, float] = {}
        for arrived_s, started_s in intervals:
            for begin_s, end_s, name in self.timeline:
                overlap_s = min(end_s, started_s) - max(begin_s, arrived_s)
                if overlap_s > 0:
                    behind[name] = behind.get(name, 0.0) + overlap_s
        log(f"what the slowest {len(intervals)} waited behind (callbacks over {self._THRESHOLD_S * 1e3:g} ms, summed):")
        for name, total_s in sorted(behind.items(), key=lambda kv: -kv[1])[:8]:
            log(f"  {total_s * 1e3:8.1f} ms  {name}")

    def report(self) -> None:
        log("event-loop callbacks over 0.2 ms in the open-loop phase (total, of it off the CPU, count, worst):")
        for name, total_s in sorted(self.total_s.items(), key=lambda kv: -kv[1])[:15]:
            log(
                f"  {total_s * 1e3:8.1f} ms {self.off_cpu_s[name] * 1e3:7.1f} ms off {self.count[name]:6d} x"
                f"  worst {self.worst_s[name] * 1e3:6.2f} ms  {name}"
            )
        total_s, off_s = sum(self.total_s.values()), sum(self.off_cpu_s.values())
        log(f"  all: {total_s * 1e3:.0f} ms, {off_s * 1e3:.0f} ms of it ({off_s / max(total_s, 1e-9):.0%}) off the CPU")


class ThreadTimes:
    """Per thread of this process, from Linux's scheduler statistics (``/proc/self/task/*/schedstat``):
    the time it ran and the time it was ready to run but waited for a core (run delay), between
    :meth:`start` and :meth:`stop`. Where the replica's wait goes when it is not its own work: a loop
    thread that waits long for a core shares it with something (its own ZMQ I/O thread, another
    process)."""

    def __init__(self) -> None:
        self._start: dict[str, tuple[str, int, int]] = {}
        self._stop: dict[str, tuple[str, int, int]] = {}

    @staticmethod
    def _read() -> dict[str, tuple[str, int, int]]:
        out: dict[str, tuple[str, int, int]] = {}
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
                run_ns, delay_ns, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
                out[tid] = (name, int(run_ns), int(delay_ns))
        return out

    def start(self) -> ThreadTimes:
        self._start = self._read()
        return self

    def stop(self) -> None:
        self._stop = self._read()

    def summary(self, elapsed_s: float) -> str:
        parts = []
        for tid, (name, run_ns, delay_ns) in sorted(self._stop.items()):
            _, run0_ns, delay0_ns = self._start.get(tid, (name, 0, 0))
            ran_s, waited_s = (run_ns - run0_ns) / 1e9, (delay_ns - delay0_ns) / 1e9
            if ran_s > 0.01 * elapsed_s or waited_s > 0.01 * elapsed_s:
                main = " (the event loop)" if int(tid) == threading.get_native_id() else ""
                parts.append(f"{name}{main} ran {ran_s / elapsed_s:.1%}, waited for a core {waited_s / elapsed_s:.1%}")
        return "; ".join(parts) or "no thread ran or waited over 1 % of the time"


class GcPauses:
    """The garbage collector's passes while started: count and seconds by generation."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.longest_s = [0.0, 0.0, 0.0]
        self._started_s = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
            return
        took_s, generation = time.perf_counter() - self._started_s, info["generation"]
        self.count[generation] += 1
        self.total_s[generation] += took_s
        self.longest_s[generation] = max(self.longest_s[generation], took_s)

    def start(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> str:
        return ", ".join(
            f"gen{g} {self.count[g]} x {self.total_s[g] * 1e3:.0f} ms (longest {self.longest_s[g] * 1e3:.2f})"
            for g in range(3)
        )


@dataclass
class SpeedResult:
    latency_s: list[float]
    cpu_s: list[float]
    num_entries: int
    bytes_per_entry: float
    num_events: int
    events_per_s: float


async def bench_speed(args: argparse.Namespace) -> SpeedResult:
    key_prefix = f"tandem-bench-fleet-{uuid.uuid4().hex[:8]}"
    num_prefill = args.workers * 3 // 4
    spec = FleetSpec(
        num_prefill=num_prefill,
        num_decode=args.workers - num_prefill,
        redis_url=REDIS_URL,
        key_prefix=key_prefix,
        block_size_tokens=BLOCK_TOKENS,
        num_kv_blocks_prefill=int(args.entries / num_prefill * 1.25) + 1024,
        num_kv_blocks_decode=20_000,
        seed=args.seed,
    )
    corpus = FleetCorpus(seed=args.seed)
    fleet = SimulatedFleet(spec, control_port=free_port(), store_port=free_port())
    log(f"(1) speed: starting {args.workers} SIMULATED workers ({num_prefill} prefill) in their own process")
    await fleet.start()
    pinned = pin_router_apart(fleet.pid) if args.pin else None
    replica = make_replica(key_prefix, "speed")
    try:
        await replica.start()
        index = replica.scheduler.index
        deadline = time.monotonic() + 120
        while replica.subscriber.num_following < args.workers and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            await replica.scheduler.refresh_workers()
        await asyncio.sleep(1.0)  # let the SUB sockets connect before anything is published
        log(f"following {replica.subscriber.num_following} publishers; filling the index to {args.entries:,} entries")
        started = time.monotonic()
        filled = asyncio.ensure_future(fleet.fill(corpus, args.entries))
        while not filled.done():
            await asyncio.sleep(2.0)
            log(f"  index: {index.num_block_entries:,} entries after {time.monotonic() - started:.0f} s")
        target = await filled
        while index.num_block_entries < target * 0.999 and time.monotonic() - started < 1800:
            await asyncio.sleep(0.5)
        fill_s = time.monotonic() - started
        num_entries = index.num_block_entries
        memory = index.approx_memory_bytes()
        log(
            f"index: {num_entries:,} (worker, block) entries (the fleet holds {target:,}) in {fill_s:.0f} s, "
            f"{memory / 2**20:.0f} MiB = {memory / max(1, num_entries):.1f} B per entry; "
            f"events {replica.subscriber.stats}"
        )
        gc.collect()
        gc.freeze()
        if os.environ.get("FLEET_NOGC"):
            gc.disable()  # the benchmark's own corpus and the index's arrays are long-lived, as in a replica
        trace = Trace(corpus, seed=args.seed + 1)
        # The decision alone, one at a time with nothing else running (released at once).
        alone: list[float] = []
        for i in range(2000):
            request, _ = trace.request(f"alone-{i}")
            t_start = time.perf_counter()
            await replica.scheduler.schedule(request)
            alone.append(time.perf_counter() - t_start)
            replica.scheduler.end_reservation(request.request_id)
        log(f"one decision at a time: p50={pct(alone, 0.5) * 1e3:.3f} ms p99={pct(alone, 0.99) * 1e3:.3f} ms")
        latencies: list[float] = []
        cpu_times: list[float] = []
        waits: list[float] = []  # from arrival until the task first ran
        walls: list[float] = []  # the decision's own wall clock
        arrivals: list[float] = []
        rnd = random.Random(args.seed + 2)
        events_before = replica.subscriber.stats.num_events
        catch_ups_before = replica.subscriber.stats.num_catch_ups
        tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        num_local = 0
        ahead: list[int] = []  # schedules not yet done when each arrived
        wait_cpus: list[float] = []  # the loop's thread's CPU time from each arrival until it ran

        schedstat_fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        start_of: dict[int, tuple[int, int]] = {}  # this thread's schedstat when request i first ran
        indices: list[int] = []  # each latency's request number

        async def one(
            request: ScheduleRequest,
            hashes: bytes,
            arrival_s: float,
            num_ahead: int,
            arrival_cpu_s: float,
            index: int = -1,
        ) -> None:
            nonlocal num_local
            c0, w0 = time.thread_time(), time.perf_counter()
            cpu_ns, run_delay_ns = os.pread(schedstat_fd, 128, 0).split()[:2]
            start_of[index] = (int(cpu_ns), int(run_delay_ns))
            placement = await replica.scheduler.schedule(request)
            cpu_times.append(time.thread_time() - c0)
            w1 = time.perf_counter()
            latencies.append(w1 - arrival_s)  # (in completion order, as every list here)
            indices.append(index)
            wait_cpus.append(c0 - arrival_cpu_s)
            ahead.append(num_ahead)
            arrivals.append(arrival_s)
            waits.append(w0 - arrival_s)
            walls.append(w1 - w0)
            worker = placement.prefill or placement.decode
            num_local += placement.prefill is None
            fleet.store(worker.worker_id, hashes)
            loop.call_later(rnd.uniform(0.5, 2.0), replica.scheduler.end_reservation, request.request_id)

        async def warm_up(request: ScheduleRequest) -> None:
            await replica.scheduler.schedule(request)
            replica.scheduler.end_reservation(request.request_id)

        log(f"open-loop schedules at {args.rate}/s for {args.seconds} s (warm-up {args.warmup_s} s not counted)")
        profiler = None
        if os.environ.get("FLEET_PROFILE"):  # where the event loop's time goes under load
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        # Requests and their arrival offsets are drawn before the clock starts (the driver's own work
        # is not the router's).
        num_requests = int(args.rate * (args.seconds + args.warmup_s))
        offsets_s: list[float] = []
        at_s = 0.0
        for _ in range(num_requests):
            at_s += rnd.expovariate(args.rate)
            offsets_s.append(at_s)
        prepared = [
            (request, fleet.encode_hashes(hashes))
            for request, hashes in (trace.request(f"fleet-{i}") for i in range(num_requests))
        ]
        # The driver's prepared trace (~8,000 requests of ~130 block hashes each) is the benchmark's,
        # not the replica's: frozen with the rest, so the collector's passes over it do not stall the
        # replica (they did: 3-6 ms pauses, the p99.9 of a Schedule).
        gc.collect()
        gc.freeze()
        stalls = LoopStalls().start() if os.environ.get("FLEET_STALLS") else None
        gc_pauses = GcPauses().start()
        thread_times = ThreadTimes().start()
        lateness_s: list[float] = []  # the threaded driver's hand-over after each arrival time

        def hand_over(index: int, arrival_s: float) -> None:
            """On the loop: request ``index`` arrived at ``arrival_s``; latency counts from there
            (waiting behind whatever the loop is doing counts)."""
            request, hashes = prepared[index]
            if offsets_s[index] < args.warmup_s:
                task = loop.create_task(warm_up(request))
            else:
                task = loop.create_task(one(request, hashes, arrival_s, len(tasks), time.thread_time(), index))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        def drive(t0: float, done: asyncio.Future[None]) -> None:
            """``--arrivals thread``: each request reaches the loop at its own time, from a thread of its
            own with call_soon_threadsafe (as Ray's threads hand a Serve replica its requests, and as a
            socket wakes a loop at once), and counts from its arrival time, so the driver's own lateness
            (sleep, the GIL) counts too. The loop driver's asyncio.sleep wakes on the millisecond
            (epoll's timeout is rounded up to it): the arrivals of each millisecond reached the loop
            together and queued behind each other, a burst Poisson arrivals rarely make. The thread runs
            on the router's core (it inherits this thread's pinning) with a timer slack of 1 ns: its
            hand-overs came p50 0.04 ms late (0.09 ms with Linux's default slack of 50 us), p99 3-4 ms
            on a shared host, on either core."""
            with contextlib.suppress(OSError, AttributeError):  # Linux: sleeps overshoot by 50 us by default
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1)
            for index, offset_s in enumerate(offsets_s):
                arrival_s = t0 + offset_s
                while (delay_s := arrival_s - time.perf_counter()) > 0:
                    time.sleep(delay_s)
                lateness_s.append(time.perf_counter() - arrival_s)
                loop.call_soon_threadsafe(hand_over, index, arrival_s)
            loop.call_soon_threadsafe(done.set_result, None)

        t0 = time.perf_counter()
        cpu0_s = time.thread_time()
        lead_s = 0.0  # before the first arrival
        sched_at_arrival: list[tuple[int, int]] = []  # the loop thread's schedstat at each arrival (socket)
        if args.arrivals == "socket":
            cpus = sorted(pinned - {min(pinned)}) if pinned else None
            lead_s = 0.5  # the driver process starts meanwhile
            driven = await drive_by_socket(t0 + lead_s, offsets_s, cpus, hand_over)
            lateness_s.extend(driven["lateness_s"])
            sched_at_arrival = list(zip(driven["loop_cpu_ns"], driven["loop_run_delay_ns"], strict=True))
        elif args.arrivals == "thread":
            done: asyncio.Future[None] = loop.create_future()
            driver = threading.Thread(target=drive, args=(t0 + 0.01, done), name="fleet-arrivals", daemon=True)
            driver.start()
            await done
            driver.join()
        else:
            for (request, hashes), offset_s in zip(prepared, offsets_s, strict=True):
                delay = t0 + offset_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                # Latency counts from here: the request is handed to the event loop (waiting behind
                # whatever the loop is doing counts; the driver's timer does not).
                sent_s = time.perf_counter()
                if offset_s < args.warmup_s:
                    task = loop.create_task(warm_up(request))
                else:
                    task = loop.create_task(one(request, hashes, sent_s, len(tasks), time.thread_time()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        elapsed_s = time.perf_counter() - t0 - lead_s - args.warmup_s
        loop_cpu_s = time.thread_time() - cpu0_s
        thread_times.stop()
        gc_pauses.stop()
        log(f"garbage collections in the open loop: {gc_pauses.summary()}")
        if lateness_s:
            log(
                f"the arrival {args.arrivals} handed requests over after their arrival time by p50="
                f"{pct(lateness_s, 0.5) * 1e3:.3f} ms p99={pct(lateness_s, 0.99) * 1e3:.3f} ms (counted in the latency)"
            )
        gaps_s = [b - a for a, b in zip(sorted(arrivals), sorted(arrivals)[1:], strict=False)]
        log(
            f"arrivals within 0.1 ms of the one before: {sum(g < 1e-4 for g in gaps_s) / max(1, len(gaps_s)):.1%} "
            f"(Poisson at {args.rate:g}/s: {1 - math.exp(-args.rate * 1e-4):.1%})"
        )
        log(
            f"the event loop's thread was on the CPU {loop_cpu_s / (elapsed_s + args.warmup_s):.0%} of the open loop; "
            f"the decisions themselves {sum(cpu_times) / (elapsed_s + args.warmup_s):.0%}"
        )
        log(f"this process's threads over the open loop: {thread_times.summary(elapsed_s + args.warmup_s)}")
        if stalls is not None:
            stalls.stop()
            stalls.report()
        if profiler is not None:
            import pstats

            profiler.disable()
            if os.environ.get("FLEET_PROFILE_OUT"):
                profiler.dump_stats(os.environ["FLEET_PROFILE_OUT"])
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats("router|policy|fleet|budget|kv_index|reservations|ledger", 40)
        num_events = replica.subscriber.stats.num_events - events_before
        log(
            f"schedule from its arrival: p50={pct(latencies, 0.5) * 1e3:.3f} ms "
            f"p99={pct(latencies, 0.99) * 1e3:.3f} ms "
            f"p99.9={pct(latencies, 0.999) * 1e3:.3f} ms; decision CPU p50={pct(cpu_times, 0.5) * 1e3:.3f} ms "
            f"p99={pct(cpu_times, 0.99) * 1e3:.3f} ms; {len(latencies)} decisions at "
            f"{len(latencies) / elapsed_s:.0f}/s "
            f"({num_local} local prefills), {num_events / elapsed_s:.0f} KV events/s applied meanwhile "
            f"({(replica.subscriber.stats.num_catch_ups - catch_ups_before) / elapsed_s:.0f} catch-ups/s); "
            f"index {index.num_block_entries:,} entries; load average {os.getloadavg()[0]:.1f} "
            f"on {os.cpu_count()} cores"
        )
        slowest = sorted(range(len(latencies)), key=latencies.__getitem__)[-max(1, len(latencies) // 100) :]
        if stalls is not None:
            stalls.waited_behind([(arrivals[i], arrivals[i] + waits[i]) for i in slowest])
        log(
            f"the slowest 1 % ({len(slowest)}): waited before running p50="
            f"{pct([waits[i] for i in slowest], 0.5) * 1e3:.3f} ms, then decided in p50="
            f"{pct([walls[i] for i in slowest], 0.5) * 1e3:.3f} ms wall, "
            f"{pct([cpu_times[i] for i in slowest], 0.5) * 1e3:.3f} ms CPU; "
            f"{sum(waits[i] > walls[i] for i in slowest)} of them waited longer than they decided; "
            f"the loop's CPU time while they waited p50={pct([wait_cpus[i] for i in slowest], 0.5) * 1e3:.3f} ms; "
            f"schedules not yet done at their arrival p50={pct([float(ahead[i]) for i in slowest], 0.5):.0f} "
            f"max={max(ahead[i] for i in slowest)} (all requests: p99={pct([float(a) for a in ahead], 0.99):.0f}); "
            f"all decisions' wall p50={pct(walls, 0.5) * 1e3:.3f} p90={pct(walls, 0.9) * 1e3:.3f} "
            f"p99={pct(walls, 0.99) * 1e3:.3f} ms, CPU p90={pct(cpu_times, 0.9) * 1e3:.3f} ms"
        )
        os.close(schedstat_fd)
        if sched_at_arrival:
            # The kernel's account of the loop thread from each arrival until the request first ran:
            # its CPU time (the loop's other work), its time runnable but off the core, and the rest.
            parts: list[tuple[float, float, float]] = []
            for i in slowest:
                at_cpu, at_delay = sched_at_arrival[indices[i]]
                run_cpu, run_delay = start_of[indices[i]]
                cpu_s, delay_s = (run_cpu - at_cpu) / 1e9, (run_delay - at_delay) / 1e9
                parts.append((cpu_s, delay_s, waits[i] - cpu_s - delay_s))
            log(
                "the slowest 1 %'s waits by the kernel's account of the loop thread (schedstat, read by the "
                f"driver after each send): on the CPU p50={pct([p[0] for p in parts], 0.5) * 1e3:.3f} ms "
                f"(sum {sum(p[0] for p in parts) * 1e3:.1f}), runnable waiting for the core "
                f"p50={pct([p[1] for p in parts], 0.5) * 1e3:.3f} ms (sum {sum(p[1] for p in parts) * 1e3:.1f}), "
                f"neither (asleep, or held off the CPU uncounted) p50={pct([p[2] for p in parts], 0.5) * 1e3:.3f} ms "
                f"(sum {sum(p[2] for p in parts) * 1e3:.1f}); "
                f"waits summed {sum(waits[i] for i in slowest) * 1e3:.1f} ms"
            )
        gc.unfreeze()
        return SpeedResult(
            latencies, cpu_times, num_entries, memory / max(1, num_entries), num_events, num_events / elapsed_s
        )
    finally:
        await replica.aclose()
        await fleet.aclose()
        await delete_prefix(key_prefix)
        if pinned is not None:
            for tid in os.listdir("/proc/self/task"):  # the main thread and the benchmark's own
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), pinned)


async def drive_by_socket(
    t0_s: float, offsets_s: Sequence[float], cpus: Sequence[int] | None, hand_over: Callable[[int, float], None]
) -> dict[str, list[Any]]:
    """``--arrivals socket``: request ``i`` reaches this loop over a Unix datagram socket from the
    driver process (benchmarks/fleet_arrivals.py) at ``t0_s + offsets_s[i]`` and is handed over with
    that arrival time; returns how late the driver sent each one (``lateness_s``, counted in the
    latency) and this thread's ``schedstat`` just after each send (``loop_cpu_ns``,
    ``loop_run_delay_ns``)."""
    loop = asyncio.get_running_loop()
    receiver, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.setblocking(False)
    done: asyncio.Future[None] = loop.create_future()
    num_left = len(offsets_s)

    def readable() -> None:
        nonlocal num_left
        while True:
            try:
                data = receiver.recv(4)
            except BlockingIOError:
                break
            index = struct.unpack("<I", data)[0]
            hand_over(index, t0_s + offsets_s[index])
            num_left -= 1
        if num_left == 0 and not done.done():
            done.set_result(None)

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as spec:
        schedstat = f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat"
        json.dump({"t0_s": t0_s, "offsets_s": list(offsets_s), "cpus": list(cpus or ()), "schedstat": schedstat}, spec)
    driver = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).resolve().parent / "fleet_arrivals.py"),
        spec.name,
        str(sender.fileno()),
        pass_fds=(sender.fileno(),),
        stdout=asyncio.subprocess.PIPE,
    )
    sender.close()
    loop.add_reader(receiver.fileno(), readable)
    try:
        await asyncio.wait_for(done, timeout=offsets_s[-1] + 60.0)
        out, _ = await driver.communicate()
    finally:
        loop.remove_reader(receiver.fileno())
        receiver.close()
        os.unlink(spec.name)
        if driver.returncode is None:
            driver.kill()
    driven: dict[str, list[Any]] = json.loads(out)
    return driven


def pin_router_apart(fleet_pid: int) -> set[int] | None:
    """Run this process (the router replica) on one core and the SIMULATED fleet's process on the
    others, as a deployment gives a router replica a core of its own; returns this process's former
    cores, to restore (None: fewer than two cores, nothing pinned). Figures with and without it:
    services/router/README.md, Fleet scale."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    os.sched_setaffinity(fleet_pid, set(cores[1:]))
    # The threads this process has so far are the benchmark's (the fleet driver's ZMQ I/O thread, which
    # sends the SIMULATED workers their stores; idle pools): they go with the fleet. The replica's own
    # threads (its subscriber's ZMQ I/O thread) start later, on the router's core.
    driver_threads = [int(t) for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
    for tid in driver_threads:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, set(cores[1:]))
    os.sched_setaffinity(0, {cores[0]})
    log(
        f"router replica pinned to core {cores[0]}, the SIMULATED fleet (and {len(driver_threads)} threads of "
        f"the benchmark's own) to cores {cores[1:]}"
    )
    return set(cores)


# -- (2) one view across replicas ------------------------------------------------------------------


def owner_of(request_id: str, replicas: Sequence[str]) -> str:
    """Rendezvous hashing: the replica a request id goes to (only a dead replica's ids move)."""
    return max(replicas, key=lambda r: hash((request_id, r)) & 0xFFFFFFFF)


@dataclass
class ReplayResult:
    num_placed: int = 0
    num_agreed: int = 0
    num_failed: int = 0
    num_prefill_differs: int = 0
    num_decode_differs: int = 0
    num_placed_after_kill: int = 0
    num_agreed_after_kill: int = 0
    hit_rate: float = math.nan
    divergence: float = math.nan
    divergence_between: float = math.nan
    replica_latency_s: list[float] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        return self.num_agreed / max(1, self.num_placed)


def _pair(decision: PlacementDecision) -> tuple[str, str]:
    return (decision.prefill.worker_id if decision.prefill is not None else "", decision.decode.worker_id)


async def replay(
    args: argparse.Namespace, *, kill_one: bool = False, drop_fraction: float = 0.0, label: str
) -> ReplayResult:
    """One replay of the multi-tenant trace over 4 replicas and the oracle (see (2) above)."""
    key_prefix = f"tandem-bench-replicas-{uuid.uuid4().hex[:8]}"
    num_prefill = args.replica_workers * 3 // 4
    entries = args.replica_entries
    spec = FleetSpec(
        num_prefill=num_prefill,
        num_decode=args.replica_workers - num_prefill,
        redis_url=REDIS_URL,
        key_prefix=key_prefix,
        block_size_tokens=BLOCK_TOKENS,
        num_kv_blocks_prefill=int(entries / num_prefill * 1.1) + 512,
        num_kv_blocks_decode=20_000,
        seed=args.seed,
    )
    corpus = FleetCorpus(seed=args.seed, num_tenants=200)
    fleet = SimulatedFleet(spec, control_port=free_port(), store_port=free_port())
    await fleet.start()
    names = ["r0", "r1", "r2", "r3"]
    replicas = {
        name: make_replica(key_prefix, name, drop_fraction=drop_fraction, drop_seed=i + 1)
        for i, name in enumerate(names)
    }
    # The oracle's ledger is alone (no replica shares its prefix): it learns placements from the driver.
    oracle = make_replica(key_prefix, "oracle", ledger_prefix=f"{key_prefix}-oracle")
    result = ReplayResult()
    live = list(names)
    try:
        for replica in (*replicas.values(), oracle):
            await replica.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            r.subscriber.num_following == args.replica_workers for r in (*replicas.values(), oracle)
        ):
            await asyncio.sleep(0.2)
            for replica in (*replicas.values(), oracle):
                await replica.scheduler.refresh_workers()
        await asyncio.sleep(1.0)
        target = await fleet.fill(corpus, entries)
        while time.monotonic() < deadline + 120 and any(
            r.scheduler.index.num_block_entries < target * 0.999 for r in (*replicas.values(), oracle)
        ):
            await asyncio.sleep(0.2)
        while any(r.ledger.num_live_replicas < 4 for r in replicas.values()):
            await asyncio.sleep(0.05)
        await fleet.command("reset")
        trace = Trace(corpus, seed=args.seed + 11)  # the same trace in every replay
        rnd = random.Random(args.seed + 12)
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[object]] = set()
        owners: dict[str, str] = {}

        def release(request_id: str) -> None:
            owner = owners.pop(request_id, None)
            if owner is not None and owner in live:
                replicas[owner].scheduler.end_reservation(request_id)
            else:  # its replica died: the release reaches another one, which forwards or finds nothing
                task = loop.create_task(replicas[live[0]].scheduler.end_reservation_anywhere(request_id))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            oracle.scheduler.reservations.end(request_id)

        async def one(index: int, request: ScheduleRequest, hashes: list[int]) -> None:
            owner = owner_of(request.request_id, live)
            replica = replicas[owner]
            oracle_workers = oracle.scheduler.intake.last_workers  # what the oracle sees now
            assert oracle_workers is not None
            try:
                expected = oracle.scheduler.decide(request, oracle_workers)
            except Exception:
                expected = None
            started = time.perf_counter()
            try:
                placement = await replica.scheduler.schedule(request)
            except Exception:
                result.num_failed += 1
                return
            result.replica_latency_s.append(time.perf_counter() - started)
            owners[request.request_id] = owner
            held = replica.scheduler.reservations.get(request.request_id)
            if held is not None:  # the oracle sees every replica's placement the moment it is made
                oracle.scheduler.reservations.reserve(
                    request.request_id, held.worker_ids, held.tokens_by_worker, tenant=held.tenant
                )
                if placement.prefill is not None:
                    uncached = held.tokens_by_worker.get(placement.prefill.worker_id, 0)
                else:
                    uncached = max(0, request.num_tokens - placement.num_decode_cached_tokens)
                oracle.scheduler.shares.add(held.tenant, uncached)
            if index >= args.replica_warmup:
                result.num_placed += 1
                agreed = expected is not None and _pair(expected) == _pair(placement)
                result.num_agreed += agreed
                if expected is not None and not agreed:
                    result.num_prefill_differs += _pair(expected)[0] != _pair(placement)[0]
                    result.num_decode_differs += _pair(expected)[1] != _pair(placement)[1]
                if len(live) < len(names):
                    result.num_placed_after_kill += 1
                    result.num_agreed_after_kill += agreed
            worker = placement.prefill or placement.decode
            fleet.store(worker.worker_id, hashes)
            loop.call_later(rnd.uniform(0.5, 2.0), release, request.request_id)

        num_requests = int(args.replica_rate * args.replica_seconds)
        t0 = time.perf_counter()
        next_s = t0
        for i in range(num_requests):
            if kill_one and i == num_requests // 2:
                dead = live.pop()
                log(f"  {label}: killing replica {dead} (no goodbye: the others notice when its liveness key expires)")
                # Everything of it stops (its upkeep too: left running, it re-followed every worker from
                # scratch); in a task of its own, so that the trace does not stall while it closes.
                killing = loop.create_task(replicas[dead].aclose())
                tasks.add(killing)
            next_s += rnd.expovariate(args.replica_rate)
            delay = next_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            request, hashes = trace.request(f"replay-{i}")
            task = loop.create_task(one(i, request, hashes))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)
        stats = await fleet.command("stats")
        result.hit_rate = stats["num_hit_blocks"] / max(1, stats["num_blocks"])
        if drop_fraction:
            # Quiescent now: let the subscribers catch up from the replay sockets, then compare.
            await asyncio.sleep(args.catch_up_wait_s)
            truth = {w: set(hashes) for w, hashes in (await fleet.dump()).items() if hashes}
            num_truth = sum(len(h) for h in truth.values())
            views = []
            for name in live:
                by_worker = replicas[name].scheduler.index.entries_by_worker()
                views.append({w: {int(h) for h in hashes} for w, hashes in by_worker.items()})

            def differ(a: dict[str, set[int]], b: dict[str, set[int]]) -> int:
                return sum(len(a.get(w, set()) ^ b.get(w, set())) for w in a.keys() | b.keys())

            result.divergence = max(differ(v, truth) for v in views) / max(1, num_truth)
            result.divergence_between = max(differ(a, b) for i, a in enumerate(views) for b in views[i + 1 :]) / max(
                1, num_truth
            )
            drops = [replicas[n].subscriber.stats for n in live]
            log(f"  {label}: subscribers {drops}")
        lags = [x for name in live for x in replicas[name].ledger.lag_s]
        log(
            f"  {label}: {result.num_placed} placements compared, agreement {result.agreement:.4f} "
            f"({result.num_prefill_differs} on prefill, {result.num_decode_differs} on decode; "
            f"{result.num_failed} failed"
            + (
                f"; after the kill {result.num_agreed_after_kill / max(1, result.num_placed_after_kill):.4f}"
                if result.num_placed_after_kill
                else ""
            )
            + f"); hit rate {result.hit_rate:.4f}; replica schedule p99 "
            f"{pct(result.replica_latency_s, 0.99) * 1e3:.3f} ms"
            + f"; ledger lag p50 {pct(lags, 0.5) * 1e3:.2f} ms p99 {pct(lags, 0.99) * 1e3:.2f} ms"
            + (
                f"; index divergence vs the workers {result.divergence:.5f}, between replicas "
                f"{result.divergence_between:.5f}"
                if drop_fraction
                else ""
            )
        )
        return result
    finally:
        for name in live:
            await replicas[name].aclose()
        await oracle.aclose()
        await fleet.aclose()
        await delete_prefix(key_prefix)
        await delete_prefix(f"{key_prefix}-oracle")


async def bench_replicas(args: argparse.Namespace) -> tuple[ReplayResult, ReplayResult, ReplayResult]:
    log(
        f"(2) one view: {args.replica_workers} SIMULATED workers, {args.replica_entries:,} entries, 4 replicas + "
        f"an oracle, {args.replica_rate:g} schedules/s for {args.replica_seconds:g} s"
    )
    full = await replay(args, label="4 replicas")
    killed = await replay(args, kill_one=True, label="one replica killed halfway")
    dropped = await replay(args, drop_fraction=0.01, label="1 % of KV events dropped")
    return full, killed, dropped


# -- (3) token-fair tenants across replicas -------------------------------------------------------

#: The fairness part's SIMULATED prefill: 0.4 s for a 2,048-token prompt (a time scale, not model speed).
FAIR_PREFILL_2K_S = 0.8
FAIR_LATENCY = SimulatedLatencyModel(
    prefill_base_s=0.0, prefill_s_per_token=FAIR_PREFILL_2K_S / 2048, decode_s_per_token=0.0
)


@dataclass
class TenantLoad:
    tenant: str
    rate_per_s: float
    prompt_tokens: int


@dataclass
class FairRun:
    ttft_s: dict[str, list[float]] = field(default_factory=dict)
    #: Schedule alone (the wait in the router's queue).
    queue_s: dict[str, list[float]] = field(default_factory=dict)
    served_tokens: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    #: Placements onto a worker still computing another prompt (replicas that decided at once).
    overbooked: dict[str, int] = field(default_factory=dict)


async def fair_run(args: argparse.Namespace, loads: Sequence[TenantLoad], seconds: float, label: str) -> FairRun:
    """Open-loop tenants through four replicas onto SIMULATED prefill workers (one prompt at a time each)."""
    key_prefix = f"tandem-bench-fair-{uuid.uuid4().hex[:8]}"
    configs = [
        SimulatedWorkerConfig(
            worker_id=f"simulated-prefill-{i}",
            role="prefill",
            num_kv_blocks=100_000,
            latency=FAIR_LATENCY,
            serve_grpc=False,
        )
        for i in range(args.fair_workers)
    ] + [
        SimulatedWorkerConfig(
            worker_id=f"simulated-decode-{i}",
            role="decode",
            num_kv_blocks=1_000_000,
            latency=FAIR_LATENCY,
            serve_grpc=False,
        )
        for i in range(4)
    ]
    cluster = SimulatedCluster(
        configs, redis_url=REDIS_URL, key_prefix=key_prefix, heartbeat_interval_s=1.0, ttl_s=10.0
    )
    await cluster.start()
    by_id = {w.config.worker_id: w for w in cluster.workers}
    names = ["f0", "f1", "f2", "f3"]
    replicas: dict[str, Replica] = {}
    for name in names:
        replicas[name] = make_replica(
            key_prefix,
            name,
            # One prompt per prefill worker: the router's queue, where the fair share is decided, holds
            # the backlog, not the engines' own first-come-first-served queues.
            budget={"prefill_tokens_in_flight": max(t.prompt_tokens for t in loads)},
            queue={"timeout_s": args.fair_queue_timeout_s},
            disaggregation={"min_uncached_tokens": 0},
        )
    result = FairRun()
    try:
        for replica in replicas.values():
            await replica.start()
        while any(r.ledger.num_live_replicas < 4 for r in replicas.values()):
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        warmup_s = 3.0
        t0 = time.perf_counter()

        async def one(load: TenantLoad, i: int) -> None:
            request_id = f"{load.tenant}-{i}-{uuid.uuid4().hex[:6]}"
            first_token = i * 10_000 + sum(load.tenant.encode()) % 1000  # a prompt nothing else shares
            prompt = list(range(first_token, first_token + load.prompt_tokens))
            replica = replicas[owner_of(request_id, names)]
            started = time.perf_counter()
            try:
                placement = await replica.scheduler.schedule(
                    ScheduleRequest(
                        request_id=request_id,
                        model="simulated-model",
                        num_prompt_tokens=len(prompt),
                        max_tokens=1,
                        tenant=load.tenant,
                    )
                )
            except NoCapacityError as exc:
                if started - t0 > warmup_s:
                    result.refused[load.tenant] = result.refused.get(load.tenant, 0) + 1
                    if os.environ.get("YIELD_DEBUG") and load.tenant == "victim":
                        log(
                            f"    refused {request_id} on {owner_of(request_id, names)} after "
                            f"{time.perf_counter() - started:.3f} s: {exc}"
                        )
                return
            assert placement.prefill is not None
            counted = started - t0 > warmup_s
            if counted:
                result.queue_s.setdefault(load.tenant, []).append(time.perf_counter() - started)
            if counted:
                result.served_tokens[load.tenant] = result.served_tokens.get(load.tenant, 0) + len(prompt)
            worker = by_id[placement.prefill.worker_id]
            if counted and worker.num_running:
                result.overbooked[load.tenant] = result.overbooked.get(load.tenant, 0) + 1
            try:
                await worker.Prefill(
                    worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, keep_kv=False),
                    None,  # type: ignore[arg-type]
                )
            finally:
                replica.scheduler.end_reservation(request_id)
            if counted:
                result.ttft_s.setdefault(load.tenant, []).append(time.perf_counter() - started)

        async def tenant(load: TenantLoad) -> None:
            rnd = random.Random(load.tenant)
            next_s = time.perf_counter()
            i = 0
            while next_s - t0 < seconds + warmup_s:
                next_s += rnd.expovariate(load.rate_per_s)
                delay = next_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = loop.create_task(one(load, i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1

        await asyncio.gather(*(tenant(load) for load in loads))
        _, stuck = await asyncio.wait(tasks, timeout=args.fair_queue_timeout_s + 30) if tasks else (None, set())
        if stuck:
            log(
                f"  {label}: {len(stuck)} requests did not finish: "
                + "; ".join(str(t.get_stack(limit=3)) for t in list(stuck)[:3])
            )
        for load in loads:
            ttft = result.ttft_s.get(load.tenant, [])
            log(
                f"  {label}: {load.tenant} ({load.rate_per_s:g}/s x {load.prompt_tokens} tokens): {len(ttft)} served, "
                f"{result.refused.get(load.tenant, 0)} refused (queue timeout), "
                f"{result.overbooked.get(load.tenant, 0)} placed on a busy worker, TTFT p50 "
                f"{pct(ttft, 0.5) * 1e3:.0f} ms p99 {pct(ttft, 0.99) * 1e3:.0f} ms (in the router's queue p50 "
                f"{pct(result.queue_s.get(load.tenant, []), 0.5) * 1e3:.0f} ms p99 "
                f"{pct(result.queue_s.get(load.tenant, []), 0.99) * 1e3:.0f} ms), "
                f"{result.served_tokens.get(load.tenant, 0):,} uncached tokens served"
            )
        return result
    finally:
        for replica in replicas.values():
            await replica.aclose()
        await cluster.aclose()
        await delete_prefix(key_prefix)


def jain_index(values: Sequence[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else math.nan


async def bench_fairness(args: argparse.Namespace) -> tuple[float, float]:
    capacity_per_s = args.fair_workers / FAIR_PREFILL_2K_S  # 2,048-token prompts
    victim_rate = capacity_per_s * args.victim_share
    log(
        f"(3) fairness: 4 replicas, {args.fair_workers} SIMULATED prefill workers (~{capacity_per_s:.0f} 2k-token "
        f"prompts/s), victim at {victim_rate:.1f}/s, noisy neighbour at 10x"
    )
    solo = await fair_run(args, [TenantLoad("victim", victim_rate, 2048)], args.fair_seconds, "victim alone")
    both = await fair_run(
        args,
        [TenantLoad("victim", victim_rate, 2048), TenantLoad("noisy", 10 * victim_rate, 2048)],
        args.fair_seconds,
        "victim beside a noisy neighbour",
    )
    ratio = pct(both.ttft_s["victim"], 0.99) / pct(solo.ttft_s["victim"], 0.99)
    sizes = (512, 1024, 2048, 4096)
    token_capacity_per_s = capacity_per_s * 2048
    # Every tenant asks for 40 % of the capacity in tokens: 160 % in all, each more than its share.
    loads = [TenantLoad(f"tenant-{n}", 0.4 * token_capacity_per_s / n, n) for n in sizes]
    mixed = await fair_run(args, loads, args.fair_seconds, "four tenants, four prompt sizes")
    served = [float(mixed.served_tokens.get(load.tenant, 0)) for load in loads]
    jain = jain_index(served)
    request_fair = jain_index([float(n) for n in sizes])
    log(
        f"  victim TTFT p99 {pct(both.ttft_s['victim'], 0.99) * 1e3:.0f} ms beside the neighbour, "
        f"{pct(solo.ttft_s['victim'], 0.99) * 1e3:.0f} ms alone: ratio {ratio:.3f}; Jain's index over served "
        f"uncached tokens {jain:.4f} (serving the four in turn by requests would give {request_fair:.2f})"
    )
    return ratio, jain


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router_fleet.py")
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--entries", type=int, default=10_000_000)
    parser.add_argument("--rate", type=float, default=250.0, help="schedules per second (open loop)")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--arrivals",
        choices=("socket", "thread", "loop"),
        default="socket",
        help="speed phase: requests reach the replica's loop over a socket from a driver process at their own "
        "times (default), from a thread of this process, or from a coroutine in the loop whose sleeps wake on "
        "the millisecond (see the module docstring)",
    )
    parser.add_argument("--replica-workers", type=int, default=128)
    parser.add_argument("--replica-entries", type=int, default=500_000)
    parser.add_argument("--replica-rate", type=float, default=100.0)
    parser.add_argument("--replica-seconds", type=float, default=40.0)
    parser.add_argument("--replica-warmup", type=int, default=300, help="requests not compared at the start")
    parser.add_argument("--catch-up-wait-s", type=float, default=4.0)
    parser.add_argument("--fair-workers", type=int, default=48)
    parser.add_argument("--fair-seconds", type=float, default=30.0)
    parser.add_argument("--victim-share", type=float, default=0.1, help="the victim's rate, as a share of capacity")
    parser.add_argument("--fair-queue-timeout-s", type=float, default=5.0)
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="speed phase: let the router and the simulated fleet share every core",
    )
    parser.add_argument(
        "--gc-young-threshold",
        type=int,
        default=RouterConfig().gc_young_threshold,
        help="the replicas' GC setting (tandem.router.gc_tuning; default: the router's; 0: Python's own)",
    )
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-replicas", action="store_true")
    parser.add_argument("--skip-fairness", action="store_true")
    args = parser.parse_args(argv)
    # This process hosts the replicas: it collects garbage as a replica does (RouterDeployment).
    tune_gc(args.gc_young_threshold)
    log(f"GC thresholds {gc.get_threshold()}")
    nan = math.nan
    p99_ms = bytes_per_block = agreement = loss = divergence = victim_ratio = jain = nan
    if not args.skip_speed:
        speed = asyncio.run(bench_speed(args))
        p99_ms, bytes_per_block = pct(speed.latency_s, 0.99) * 1e3, speed.bytes_per_entry
    if not args.skip_replicas:
        full, killed, dropped = asyncio.run(bench_replicas(args))
        agreement = full.agreement
        loss = (full.hit_rate - killed.hit_rate) / full.hit_rate if full.hit_rate else nan
        divergence = dropped.divergence
    if not args.skip_fairness:
        victim_ratio, jain = asyncio.run(bench_fairness(args))
    print(
        f"bench-router-fleet: schedule_p99_ms={p99_ms:.3f} bytes_per_block={bytes_per_block:.1f} "
        f"replica_agreement={agreement:.4f} hit_rate_loss_one_replica={loss:.4f} "
        f"victim_ttft_p99_ratio={victim_ratio:.3f} jain={jain:.4f} index_divergence={divergence:.5f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
