"""Adapter-aware placement under Zipf popularity (``make bench-adapters``, issue 40): adapter loads per
minute per worker and TTFT p99 against a run of the same load with one adapter.

SIMULATED workers (:mod:`tandem.local.simulated_worker`: no model runs; an adapter is its name and a
load costs ``--load-s`` of engine time, during which the worker prefills nothing) registered in the
real Redis registry, publishing their KV events over ZMQ, with ``--slots`` adapter slots each (vLLM's
``max_loras``), least recently used evicted. The real router pieces decide: a replica built by
:func:`tandem.router.replica.build_replica` (registry view, KV-event subscriber, budgets, queue), whose
placements are then run on the SIMULATED workers in this process (their gRPC servers are not used:
the figures are about where requests go, not about the transport). Each request: Schedule, then the
prefill worker's Prefill (TTFT is from the request's arrival to the end of its Prefill, queueing in
the router included), then the decode worker's Decode streamed to its end, then the reservation ends.

Open loop: Poisson arrivals at ``--rate`` for ``--warmup-s`` (not measured: the first loads of every
adapter) plus ``--duration-s`` (measured), the same arrival times and prompts for every run. Three
runs of the same load, one after another, each on fresh workers and a fresh Redis prefix:

* ``one adapter``: every request names the same adapter (the reference TTFT);
* ``adapter-aware``: ``--adapters`` adapters, Zipf(``--zipf``) popularity, the router as configured;
* ``adapter-blind``: the same requests, the adapter scorer's weight 0 and no overlay (the filter
  still keeps them off workers with LoRA off): the baseline.

Each adapter's prompts start with a system prompt of its own, hashed with the adapter as vLLM does
(so they are that adapter's cache only), then a part no other request shares. Figures from SIMULATED
workers describe the router's placement, never model speed. Ends with one line::

    bench-adapters: loads_per_min_per_worker=… ttft_p99_ratio_vs_one_adapter=… hit_rate=…

(the adapter-aware run's: steady-state loads per minute per worker, both roles; its TTFT p99 over the
one-adapter run's; the share of its requests whose prefill and decode workers both held the adapter
already). Targets: ≤ 1 load per minute per worker, ratio ≤ 1.5.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from tandem.common.block_hash import BlockHasher
from tandem.common.errors import NoCapacityError
from tandem.local.simulated_worker import (
    SimulatedCluster,
    SimulatedLatencyModel,
    SimulatedWorkerConfig,
    simulated_adapter_path,
)
from tandem.router.policy import ScheduleRequest
from tandem.router.replica import build_replica
from tandem.router.settings import RouterConfig
from tandem.v1 import common_pb2, worker_pb2

REDIS_URL = "redis://127.0.0.1:6379/0"
BLOCK_TOKENS = 16
SYSTEM_TOKENS = 64


@dataclass(frozen=True)
class Arrival:
    at_s: float
    adapter_rank: int
    prompt: tuple[int, ...]


@dataclass
class RunResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    #: Per worker id, its adapter loads after the warm-up.
    loads: dict[str, int] = field(default_factory=dict)
    num_workers: int = 0
    num_hits: int = 0
    num_placed: int = 0
    num_refused: int = 0


def zipf_weights(num: int, s: float) -> list[float]:
    raw = [1.0 / (rank**s) for rank in range(1, num + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def arrivals(args: argparse.Namespace) -> list[Arrival]:
    rng = random.Random(args.seed)
    weights = zipf_weights(args.adapters, args.zipf)
    out: list[Arrival] = []
    t = 0.0
    end_s = args.warmup_s + args.duration_s
    n = 0
    while True:
        t += rng.expovariate(args.rate)
        if t >= end_s:
            return out
        rank = rng.choices(range(args.adapters), weights)[0]
        system = [1000 + rank * 997 + k for k in range(SYSTEM_TOKENS)]
        user = [50_000 + (n * 7919 + k * 104_729) % 40_000 for k in range(args.prompt_tokens - SYSTEM_TOKENS)]
        out.append(Arrival(t, rank, tuple(system + user)))
        n += 1


class _Context:
    """The little of a gRPC servicer context the SIMULATED worker uses (never reached here: every
    worker has LoRA on)."""

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


async def run_once(
    name: str, args: argparse.Namespace, load: Sequence[Arrival], adapter_names: Sequence[str], blind: bool
) -> RunResult:
    prefix = f"bench-adapters-{uuid.uuid4().hex[:8]}"
    latency = SimulatedLatencyModel()  # its defaults: a prefill of 320 tokens takes 0.21 s
    configs = [
        SimulatedWorkerConfig(
            worker_id=f"simulated-{role}-{i}",
            role=role,
            model="simulated-model",
            block_size_tokens=BLOCK_TOKENS,
            num_kv_blocks=args.kv_blocks,
            latency=latency,
            serve_grpc=False,
            max_adapters=args.slots,
            adapter_load_s=args.load_s,
        )
        for role in ("prefill", "decode")
        for i in range(args.workers)
    ]
    cluster = SimulatedCluster(configs, redis_url=REDIS_URL, key_prefix=prefix, heartbeat_interval_s=1.0, ttl_s=5.0)
    await cluster.start()
    config: dict[str, Any] = {
        "redis": {"url": REDIS_URL},
        "registry": {"key_prefix": prefix, "heartbeat_interval_s": 1.0, "ttl_s": 5.0},
        "disaggregation": {"min_uncached_tokens": 0},
        "budget": {"prefill_tokens_in_flight": args.prefill_budget_tokens},
        "queue": {"timeout_s": 30.0},
    }
    if blind:
        config["weights"] = {"adapter_affinity": 0.0}
    replica = build_replica(RouterConfig.model_validate(config), follow_kv_events=True)
    scheduler = replica.scheduler
    if blind:
        scheduler._placer.adapters.ttl_s = 0.0  # the records alone: no overlay
    await scheduler.refresh_workers()
    by_id = {w.config.worker_id: w for w in cluster.workers}
    hasher = BlockHasher(BLOCK_TOKENS)
    result = RunResult(name, num_workers=len(cluster.workers))
    context: Any = _Context()

    async def one(i: int, arrival: Arrival, started_s: float) -> None:
        adapter = adapter_names[arrival.adapter_rank]
        hashes = hasher.block_hashes(arrival.prompt, lora_name=adapter, lora_path=simulated_adapter_path(adapter))
        request = ScheduleRequest(
            request_id=f"{name}-{i}",
            model="simulated-model",
            num_prompt_tokens=len(arrival.prompt),
            max_tokens=args.max_tokens,
            prompt_block_hashes={(BLOCK_TOKENS, hasher.none_hash_seed): hashes},
            adapter=adapter,
        )
        arrived_s = started_s + arrival.at_s
        try:
            decision = await scheduler.schedule(request)
        except NoCapacityError:
            result.num_refused += 1
            return
        measured = arrival.at_s >= args.warmup_s
        try:
            assert decision.prefill is not None
            prefill, decode = by_id[decision.prefill.worker_id], by_id[decision.decode.worker_id]
            hit = adapter in prefill.adapters and adapter in decode.adapters
            await prefill.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=request.request_id, prompt_token_ids=arrival.prompt, adapter=adapter, keep_kv=True
                ),
                context,
            )
            if measured:
                result.ttft_s.append(time.monotonic() - arrived_s)
                result.num_placed += 1
                result.num_hits += hit
            decode_request = worker_pb2.DecodeRequest(
                request_id=request.request_id,
                prompt_token_ids=arrival.prompt,
                adapter=adapter,
                sampling=common_pb2.SamplingOptions(max_tokens=args.max_tokens),
            )
            async for _ in decode.Decode(decode_request, context):
                pass
        finally:
            scheduler.end_reservation(request.request_id)

    started_s = time.monotonic()
    tasks: list[asyncio.Task[None]] = []
    for i, arrival in enumerate(load):
        delay_s = started_s + arrival.at_s - time.monotonic()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one(i, arrival, started_s)))
    await asyncio.gather(*tasks)
    steady_from_s = started_s + args.warmup_s
    for worker in cluster.workers:
        result.loads[worker.config.worker_id] = sum(1 for at_s, _ in worker.adapter_loads if at_s >= steady_from_s)
    await replica.aclose()
    await cluster.aclose()
    await _forget(prefix)
    return result


async def _forget(prefix: str) -> None:
    client = aioredis.from_url(REDIS_URL)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def p99(values: Sequence[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def p50(values: Sequence[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def loads_per_min_per_worker(result: RunResult, duration_s: float) -> float:
    return sum(result.loads.values()) / (duration_s / 60.0) / max(1, result.num_workers)


def report(results: Sequence[RunResult], args: argparse.Namespace) -> str:
    one = results[0]
    print(
        f"SIMULATED workers: {args.workers} prefill + {args.workers} decode, {args.slots} adapter slots each, "
        f"a load {args.load_s:g} s of engine time; {args.adapters} adapters, Zipf s={args.zipf:g}; "
        f"{args.rate:g} requests/s open loop, {args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens; "
        f"warm-up {args.warmup_s:g} s, measured {args.duration_s:g} s"
    )
    print(
        f"{'run':<15} {'requests':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'p99 ratio':>10} "
        f"{'loads/min/worker':>17} {'max/worker':>11} {'hit rate':>9} {'refused':>8}"
    )
    for r in results:
        per_worker_max = max(r.loads.values(), default=0) / (args.duration_s / 60.0)
        print(
            f"{r.name:<15} {r.num_placed:>8} {p50(r.ttft_s) * 1000:>12.1f} {p99(r.ttft_s) * 1000:>12.1f} "
            f"{p99(r.ttft_s) / p99(one.ttft_s):>10.2f} {loads_per_min_per_worker(r, args.duration_s):>17.2f} "
            f"{per_worker_max:>11.1f} {r.num_hits / max(1, r.num_placed):>9.3f} {r.num_refused:>8}"
        )
    aware = results[1]
    return (
        f"bench-adapters: loads_per_min_per_worker={loads_per_min_per_worker(aware, args.duration_s):.3f} "
        f"ttft_p99_ratio_vs_one_adapter={p99(aware.ttft_s) / p99(one.ttft_s):.3f} "
        f"hit_rate={aware.num_hits / max(1, aware.num_placed):.3f}"
    )


async def main_async(args: argparse.Namespace) -> str:
    load = arrivals(args)
    names = [f"adapter-{k:02d}@1" for k in range(args.adapters)]
    single = [Arrival(a.at_s, 0, a.prompt) for a in load]
    results = [
        await run_once("one adapter", args, single, names, blind=False),
        await run_once("adapter-aware", args, load, names, blind=False),
        await run_once("adapter-blind", args, load, names, blind=True),
    ]
    return report(results, args)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=12, help="SIMULATED workers per role (default 12)")
    parser.add_argument("--slots", type=int, default=2, help="adapter slots per worker, max_loras (default 2)")
    parser.add_argument("--adapters", type=int, default=20, help="adapters (default 20)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity (default 1)")
    parser.add_argument("--rate", type=float, default=16.0, help="requests per second, open loop (default 16)")
    parser.add_argument("--warmup-s", type=float, default=8.0, help="seconds not measured (default 8)")
    parser.add_argument("--duration-s", type=float, default=32.0, help="seconds measured per run (default 32)")
    parser.add_argument("--load-s", type=float, default=0.3, help="SIMULATED adapter load, engine seconds (0.3)")
    parser.add_argument("--prompt-tokens", type=int, default=320, help="prompt tokens (default 320)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens (default 16)")
    parser.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per worker (default 2048)")
    parser.add_argument(
        "--prefill-budget-tokens",
        type=int,
        default=1536,
        help="the router's prefill budget in prompt tokens in flight per worker (1536: ~1 s of SIMULATED prefill)",
    )
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if args.workers < 1 or args.slots < 1 or args.adapters < 1 or args.rate <= 0 or args.duration_s <= 0:
        parser.error("workers, slots, adapters, rate and duration must be positive")
    if args.prompt_tokens <= SYSTEM_TOKENS:
        parser.error(f"--prompt-tokens must be above the {SYSTEM_TOKENS}-token system prompt")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        print(asyncio.run(main_async(args)), flush=True)


if __name__ == "__main__":
    main()
