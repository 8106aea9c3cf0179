"""The router for real: ``python -m tandem.router`` (local Ray + Serve's gRPC
proxy) as a subprocess, fake workers heartbeating into the real Redis, and
RouterClient as the gateway would use it.

Ray takes 10-40 s to start on a small box, so the router starts once per
module. Each test registers its own workers under its own model name, so
reservations left by one test do not steer another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import redis
from tandem_operator.autoscale import decide
from tandem_operator.signals import QueryScope, parse_router_metrics
from tandem_operator.spec import AutoscalingSpec, PoolSpec, SloSpec

from tandem.common.errors import InvalidRequestError, NoCapacityError
from tandem.common.registry import WorkerRecord, WorkerRegistry
from tandem.common.router_client import RouterClient
from tandem.gateway.app import build_app
from tandem.gateway.prompt import HfPromptTokenizer
from tandem.gateway.readiness import GrpcConnectProbe, RouterAndWorkersReadiness
from tandem.gateway.router import connect_router
from tandem.gateway.settings import GatewaySettings
from tandem.router.settings import DEFAULT_MIN_UNCACHED_TOKENS_TO_DISAGGREGATE
from tests.kit.gateway import make_tokenizer_dir
from tests.kit.promql import check_promql, series_from_exposition
from tests.kit.router import RouterProcess, router_process
from tests.kit.router_export import label_shapes, recorded_router_export, with_pending_demand

REDIS_URL = "redis://127.0.0.1:6379/0"
#: The router reads the registry at most this often (TANDEM_ROUTER_REGISTRY_REFRESH_INTERVAL_S default).
REFRESH_INTERVAL_S = 0.5
WORKER_TTL_S = 2.0
HEARTBEAT_INTERVAL_S = 0.4

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]


def redis_is_up() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    if not redis_is_up():
        pytest.skip(f"Redis not reachable at {REDIS_URL}")
    with router_process(
        tmp_path_factory.mktemp("router"),
        REDIS_URL,
        key_prefix=f"tandem-test-router-{uuid.uuid4().hex[:8]}",
        REGISTRY__TTL_S=str(WORKER_TTL_S),
        REGISTRY_REFRESH_INTERVAL_S=str(REFRESH_INTERVAL_S),
    ) as process:
        yield process


class FakeWorkers:
    """Worker records kept alive by heartbeats, as real workers would."""

    def __init__(self, key_prefix: str, records: list[WorkerRecord]) -> None:
        self.registry = WorkerRegistry(REDIS_URL, key_prefix=key_prefix, ttl_s=WORKER_TTL_S)
        self.records = {r.worker_id: r for r in records}
        self.alive = set(self.records)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._beat()
        self._task = asyncio.create_task(self._loop())
        # Let the router's registry cache see them.
        await asyncio.sleep(REFRESH_INTERVAL_S + 0.2)

    async def _beat(self) -> None:
        for worker_id in self.alive:
            await self.registry.heartbeat(self.records[worker_id])

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            await self._beat()

    def computing(self, worker_id: str, num_prompt_tokens: int) -> None:
        """From the next heartbeat, the worker reports ``num_prompt_tokens`` in flight, as a prefill worker
        computing a prompt does (the router's prefill budget and backlog gauge trust that report for a
        reservation older than a heartbeat: tandem.router.gauges)."""
        record = self.records[worker_id]
        load = dataclasses.replace(record.load, num_prompt_tokens_in_flight=num_prompt_tokens)
        self.records[worker_id] = dataclasses.replace(record, load=load)

    def stop_heartbeat(self, worker_id: str) -> None:
        """The worker hangs or dies: no unregister, its record just stops being refreshed."""
        self.alive.discard(worker_id)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for worker_id in self.records:
            await self.registry.unregister(worker_id)
        await self.registry.aclose()


def pool(model: str, num_prefill: int = 2, num_decode: int = 2) -> list[WorkerRecord]:
    def rec(name: str, role: str, port: int) -> WorkerRecord:
        return WorkerRecord(worker_id=f"{model}-{name}", role=role, model=model, address=f"127.0.0.1:{port}")

    return [rec(f"p{i}", "prefill", 7000 + i) for i in range(num_prefill)] + [
        rec(f"d{i}", "decode", 7100 + i) for i in range(num_decode)
    ]


@pytest_asyncio.fixture
async def client(router: RouterProcess) -> AsyncIterator[RouterClient]:
    async with RouterClient(router.address, timeout_s=5.0) as c:
        yield c


@pytest_asyncio.fixture
async def workers(router: RouterProcess, request: pytest.FixtureRequest) -> AsyncIterator[FakeWorkers]:
    model = f"model-{request.node.name}"[:60]
    fake = FakeWorkers(router.key_prefix, pool(model))
    await fake.start()
    yield fake
    await fake.close()


#: Prompt tokens above the router's default disaggregation threshold: placed on a (prefill, decode) pair.
LONG_PROMPT_TOKENS = DEFAULT_MIN_UNCACHED_TOKENS_TO_DISAGGREGATE + 1


def model_of(workers: FakeWorkers) -> str:
    return next(iter(workers.records.values())).model


async def test_schedule_returns_one_worker_of_each_role(client: RouterClient, workers: FakeWorkers) -> None:
    model = model_of(workers)
    placement = await client.schedule("req-roles", model, num_prompt_tokens=LONG_PROMPT_TOKENS, max_tokens=8)
    assert placement.request_id == "req-roles"
    assert not placement.local_prefill
    assert placement.prefill.role == "prefill" and placement.decode.role == "decode"
    assert placement.prefill.worker_id in workers.records and placement.decode.worker_id in workers.records
    assert placement.prefill.address == workers.records[placement.prefill.worker_id].address
    assert placement.lease_s == 600
    assert placement.reason.startswith("cache_aware ")  # the default policy
    assert await client.release("req-roles") is True


async def test_a_short_prompt_is_placed_on_a_decode_worker_alone(client: RouterClient, workers: FakeWorkers) -> None:
    model = model_of(workers)
    placement = await client.schedule("req-short", model, num_prompt_tokens=12, max_tokens=8)
    assert placement.local_prefill and not placement.HasField("prefill")
    assert placement.decode.worker_id in workers.records
    assert "local_prefill" in placement.reason
    assert await client.release("req-short") is True


async def test_concurrent_unreleased_requests_spread_and_release_frees(
    client: RouterClient, workers: FakeWorkers
) -> None:
    model = model_of(workers)
    placements = await asyncio.gather(*(client.schedule(f"req-spread-{i}", model) for i in range(4)))
    assert Counter(p.prefill.worker_id for p in placements) == {f"{model}-p0": 2, f"{model}-p1": 2}
    assert Counter(p.decode.worker_id for p in placements) == {f"{model}-d0": 2, f"{model}-d1": 2}

    # Free one slot on p0 only: the next request must land there.
    on_p0 = [p for p in placements if p.prefill.worker_id == f"{model}-p0"]
    assert await client.release(on_p0[0].request_id) is True
    assert await client.release(on_p0[0].request_id) is False  # idempotent
    follow_up = await client.schedule("req-spread-next", model)
    assert follow_up.prefill.worker_id == f"{model}-p0"
    for p in [*placements, follow_up]:
        await client.release(p.request_id)


async def test_exclude_worker_ids_is_honoured(client: RouterClient, workers: FakeWorkers) -> None:
    model = model_of(workers)
    for i in range(4):
        placement = await client.schedule(f"req-excl-{i}", model, exclude_worker_ids=[f"{model}-p0", f"{model}-d1"])
        assert (placement.prefill.worker_id, placement.decode.worker_id) == (f"{model}-p1", f"{model}-d0")
        await client.release(placement.request_id)


async def test_no_decode_worker_is_no_capacity(router: RouterProcess, client: RouterClient) -> None:
    fake = FakeWorkers(router.key_prefix, pool("model-prefill-only", num_prefill=2, num_decode=0))
    await fake.start()
    try:
        with pytest.raises(NoCapacityError, match="no decode worker"):
            await client.schedule("req-nocap", "model-prefill-only")
    finally:
        await fake.close()


async def test_a_pool_at_zero_is_a_503_and_pending_demand_the_operator_reads(
    router: RouterProcess, tmp_path: Path
) -> None:
    """Scale from zero (issue 42 item 4) on the real router, with SIMULATED workers (registry records
    only: no request reaches them). The gateway (its real app, router client and readiness) in front of
    a model whose decode pool is at zero: /readyz is 200 with no decode worker counted, a request is a
    503 with Retry-After in OpenAI's error shape naming no internal address, and the router's real
    export carries the pending demand that the operator's own parser reads and its decision acts on
    within one interval."""
    model = "model-decode-at-zero"
    fake = FakeWorkers(router.key_prefix, pool(model, num_prefill=1, num_decode=0))
    await fake.start()
    tokenizer = HfPromptTokenizer.from_dir(make_tokenizer_dir(tmp_path / "tokenizer"))
    settings = GatewaySettings(served_model_name=model, max_model_len=64, auth={"mode": "disabled"})
    gateway_router = connect_router(router.address, timeout_s=5.0)
    registry = WorkerRegistry(REDIS_URL, key_prefix=router.key_prefix)
    readiness = RouterAndWorkersReadiness(
        GrpcConnectProbe(router.address, timeout_s=2.0), registry, cache_s=0.0, timeout_s=2.0
    )
    app = build_app(settings, router=gateway_router, tokenizer=tokenizer, readiness=readiness)
    hostile = "hello \u202e東京 <script>alert(1)</script> \x00 🚀"
    try:
        async with (
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http,
            app.router.lifespan_context(app),
        ):
            ready = await http.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert ready.json()["num_decode_workers"] == 0 and "no decode worker" in ready.json()["detail"]
            for stream in (False, True):
                body = {"model": model, "messages": [{"role": "user", "content": hostile}], "stream": stream}
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"] == "10"
                assert response.json() == {
                    "error": {
                        "message": "No worker can take this request now; retry after the Retry-After delay.",
                        "type": "server_error",
                        "param": None,
                        "code": "no_capacity",
                    }
                }
                assert "127.0.0.1" not in response.text and "7000" not in response.text
    finally:
        await gateway_router.aclose()
        await registry.aclose()
        await fake.close()

    text = await _scrape_until(
        router, lambda text: (parse_router_metrics(text, "decode", model).pending_demand or 0) >= 2
    )
    decode = parse_router_metrics(text, "decode", model)
    assert decode.pending_demand == 2, [line for line in text.splitlines() if "pending_demand" in line]
    assert parse_router_metrics(text, "prefill", model).pending_demand is None  # prefill has its worker
    # The sample the operator's kmock test adds to the recorded export has the live series' shape.
    live = {shape for shape in label_shapes(text) if shape[0] == "ray_tandem_router_pending_demand"}
    assert live == {
        shape
        for shape in label_shapes(with_pending_demand(recorded_router_export(), "decode", 1))
        if shape[0] == "ray_tandem_router_pending_demand"
    }
    at_zero = PoolSpec(replicas=0, min_replicas=0, max_replicas=4)
    decision, _ = decide(
        role="decode", current_replicas=0, signals=decode, pool=at_zero, policy=AutoscalingSpec(),
        slo=SloSpec(), history=(), now_s=0.0, ready_replicas=0,
    )
    assert decision.desired_replicas == 1 and decision.reason.startswith("scale from zero: pending_demand"), decision


async def test_unknown_model_is_invalid_request(client: RouterClient, workers: FakeWorkers) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await client.schedule("req-unknown", "no-such-model")
    assert info.value.code == "model_not_found"


async def test_worker_whose_heartbeat_stopped_disappears_within_ttl(client: RouterClient, workers: FakeWorkers) -> None:
    model = model_of(workers)
    placement = await client.schedule("req-ttl-0", model, exclude_worker_ids=[f"{model}-d1"])
    assert placement.decode.worker_id == f"{model}-d0"
    await client.release("req-ttl-0")

    workers.stop_heartbeat(f"{model}-d0")
    stopped_s = time.monotonic()
    bound_s = WORKER_TTL_S + HEARTBEAT_INTERVAL_S + REFRESH_INTERVAL_S + 1.0
    while True:
        try:
            await client.schedule("req-ttl", model, exclude_worker_ids=[f"{model}-d1"])
            await client.release("req-ttl")
        except NoCapacityError:
            break
        assert time.monotonic() - stopped_s < bound_s, "dead worker still scheduled after its TTL"
        await asyncio.sleep(0.1)
    # And the survivors still get traffic.
    placement = await client.schedule("req-ttl-after", model)
    assert placement.decode.worker_id == f"{model}-d1"
    await client.release("req-ttl-after")


async def test_startup_and_schedule_latency(router: RouterProcess, client: RouterClient, workers: FakeWorkers) -> None:
    model = model_of(workers)
    latencies_s = []
    for i in range(100):
        started_s = time.perf_counter()
        await client.schedule(f"req-lat-{i}", model)
        latencies_s.append(time.perf_counter() - started_s)
        await client.release(f"req-lat-{i}")
    latencies_s.sort()
    p50_ms, p99_ms = latencies_s[49] * 1000, latencies_s[98] * 1000
    print(
        f"\nrouter startup {router.startup_s:.1f} s (router's own count {router.ready_line['startup_s']} s); "
        f"Schedule via Serve gRPC proxy p50 {p50_ms:.1f} ms p99 {p99_ms:.1f} ms "
        f"mean {statistics.mean(latencies_s) * 1000:.1f} ms"
    )
    assert p50_ms < 100, f"Schedule p50 {p50_ms:.1f} ms"


async def _scrape_until(router: RouterProcess, done: Callable[[str], bool], timeout_s: float = 45) -> str:
    """Ray's export (every ~10 s; custom metrics prefixed with "ray_") once ``done`` holds, or the last one."""
    deadline_s = time.monotonic() + timeout_s
    text = ""
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline_s:
            text = (await http.get(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=5)).text
            if done(text):
                break
            await asyncio.sleep(1)
    return text


#: The router's count of uncached prompt tokens arriving for the prefill pool (the operator's token_rate).
PREFILL_ARRIVALS = "ray_tandem_router_prefill_arrived_uncached_tokens_total"


def _model_values(text: str, name: str, model: str) -> list[float]:
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"{name}{{") and f'model="{model}"' in line
    ]


async def test_metrics_reach_rays_prometheus_endpoint(
    router: RouterProcess, client: RouterClient, workers: FakeWorkers, tmp_path: Path
) -> None:
    """Two models' workers in one router: the real export, read by the operator's parser per model,
    gives each model's pools its own load and none of the other's; a model whose workers left reads
    no stale load."""
    model = model_of(workers)
    other_model = f"{model[:50]}-other"
    others = FakeWorkers(router.key_prefix, pool(other_model, num_prefill=1, num_decode=1))
    await others.start()
    closed = False
    try:
        placement = await client.schedule("req-metrics", model, num_prompt_tokens=300, max_tokens=20)
        short = await client.schedule("req-metrics-short", model, num_prompt_tokens=12, max_tokens=8)
        await client.release(short.request_id)
        other = await client.schedule("req-metrics-other", other_model, num_prompt_tokens=500, max_tokens=20)
        other_short = await client.schedule("req-metrics-other-short", other_model, num_prompt_tokens=12)
        # Their prefill workers are computing the two prompts (no engine here finishes them). Without that
        # report the backlog gauge drops a reservation a heartbeat after placement (6f6ca7f), and the clean-clone
        # CI's scrape, later than a heartbeat, read 0 of 300.
        workers.computing(placement.prefill.worker_id, 300)
        others.computing(other.prefill.worker_id, 500)
        text = await _scrape_until(
            router,
            lambda text: (
                f'worker_id="{placement.decode.worker_id}"' in text
                and "tandem_router_schedule_seconds" in text
                and "tandem_router_queued_requests" in text
                and parse_router_metrics(text, "decode", model).in_flight == 1
                and parse_router_metrics(text, "decode", other_model).in_flight == 2
                and _model_values(text, PREFILL_ARRIVALS, other_model) == [500.0]
            ),
        )
        await client.release("req-metrics")
        assert "ray_tandem_router_schedule_seconds_count" in text
        # The prefill pool's demand as it arrives, per model: each long prompt once; the short ones went to a
        # decode worker alone and are no prefill demand.
        assert _model_values(text, PREFILL_ARRIVALS, model) == [300.0]
        assert _model_values(text, PREFILL_ARRIVALS, other_model) == [500.0]
        # The recorded export the operator's unit tests read (tests/kit/router_export.py) is still this
        # export's: every series in it has a live one of the same name and label keys.
        recorded = label_shapes(recorded_router_export())
        assert recorded and recorded <= label_shapes(text), recorded - label_shapes(text)
        paths = {
            path: line
            for line in text.splitlines()
            if line.startswith("ray_tandem_router_placements_total{") and f'model="{model}"' in line
            for path in ("disaggregated", "local_prefill")
            if f'path="{path}"' in line
        }
        assert set(paths) == {"disaggregated", "local_prefill"}, paths
        gauge = [
            line
            for line in text.splitlines()
            if line.startswith("ray_tandem_router_in_flight_requests{")
            and f'worker_id="{placement.decode.worker_id}"' in line
        ]
        assert gauge and f'model="{model}"' in gauge[0] and gauge[0].endswith(" 1.0"), gauge

        # The operator's parser reads the real export: each model's pools their own quantities, nothing
        # of the other model's, nothing of the other pool's.
        prefill = parse_router_metrics(text, "prefill", model)
        assert prefill.uncached_tokens == 300 and prefill.queue_depth == 0, prefill
        decode = parse_router_metrics(text, "decode", model)
        assert decode.waiting == 0 and decode.uncached_tokens is None, decode
        # One request placed on each pool; the prefill budget in use is its 300 uncached tokens (these
        # registry records carry no KV size, so decode's budget is unbounded and reads 0).
        assert prefill.in_flight == 1 and decode.in_flight == 1, (prefill, decode)
        assert decode.budget_usage == 0.0, decode
        other_prefill = parse_router_metrics(text, "prefill", other_model)
        other_decode = parse_router_metrics(text, "decode", other_model)
        assert other_prefill.uncached_tokens == 500 and other_prefill.in_flight == 1, other_prefill
        assert other_decode.in_flight == 2, other_decode  # the short one went to decode alone
        # The single-model form (no selection) counts both: every model's load is the one pool's.
        everything = parse_router_metrics(text, "prefill")
        assert everything.uncached_tokens is not None and everything.uncached_tokens >= 800, everything
        # The operator's PromQL over the same export (promtool): each model's pool its own figures; the
        # single-model form's unselected queries what the parser reads unselected.
        scope = QueryScope(namespace="ns", deployment_name="tandem")
        expected: dict[str, float | None] = {}
        for name, num_tokens, num_on_decode in ((model, 300, 1), (other_model, 500, 2)):
            prefill_queries = scope.queries("prefill", model=name)
            decode_queries = scope.queries("decode", model=name)
            expected[prefill_queries["uncached_tokens"]] = num_tokens
            expected[prefill_queries["in_flight"]] = 1
            expected[prefill_queries["queue_depth"]] = 0
            expected[decode_queries["in_flight"]] = num_on_decode
            expected[decode_queries["waiting"]] = 0
            expected[decode_queries["budget_usage"]] = 0.0
        expected[scope.queries("prefill")["uncached_tokens"]] = everything.uncached_tokens
        expected[scope.queries("prefill")["in_flight"]] = everything.in_flight
        expected[scope.queries("decode", model="absent")["in_flight"]] = None
        check_promql(tmp_path, series_from_exposition(text, {"namespace": "ns"}), expected)

        # The other model's workers go away with a request still placed on them: once the registry
        # forgets them, its pools read zero (or nothing), never the load they had.
        await others.close()
        closed = True
        await client.release(other.request_id)
        await client.release(other_short.request_id)
        pool_series = (
            "ray_tandem_router_pool_in_flight_requests",
            "ray_tandem_router_pool_budget_used_fraction",
            "ray_tandem_router_queued_requests",
        )
        text = await _scrape_until(
            router,
            lambda text: not any(v for name in pool_series for v in _model_values(text, name, other_model)),
        )
        stale = {name: _model_values(text, name, other_model) for name in pool_series}
        assert not any(v for values in stale.values() for v in values), stale
        assert parse_router_metrics(text, "prefill", other_model).uncached_tokens in (None, 0.0)
    finally:
        if not closed:
            await others.close()


async def test_a_burst_runs_on_the_decode_worker_and_the_real_export_counts_it(
    router: RouterProcess, client: RouterClient
) -> None:
    """The router's defaults (burst local prefills on, tandem.router.burst): a long prompt whose one
    prefill worker has another long prompt ahead of it runs on the decode worker alone, says so in its
    reason, and Ray's export counts it as ray_tandem_router_burst_local_prefills_total{model}, and as prefill
    demand arrived (ray_tandem_router_prefill_arrived_uncached_tokens_total) but not placed there."""
    model = "model-burst"  # ASCII: a non-ASCII served model name fails in Ray's metric tags (see the report)
    fake = FakeWorkers(router.key_prefix, pool(model, num_prefill=1, num_decode=1))
    await fake.start()
    try:
        ahead = await client.schedule("req-burst-ahead", model, num_prompt_tokens=2000, max_tokens=16)
        assert not ahead.local_prefill and ahead.prefill.worker_id == f"{model}-p0"
        # 2,000 tokens ahead on p0 against 0.25 x (1 + 1) x 2,000 on d0.
        burst = await client.schedule("req-burst 'x'; DROP", model, num_prompt_tokens=2000, max_tokens=16)
        assert burst.local_prefill and not burst.HasField("prefill"), burst.reason
        assert "local_prefill burst wait=2000 extra=1000" in burst.reason
        name = "ray_tandem_router_burst_local_prefills_total"
        text = await _scrape_until(
            router,
            lambda text: (
                _model_values(text, name, model) == [1.0] and _model_values(text, PREFILL_ARRIVALS, model) == [4000.0]
            ),
        )
        assert _model_values(text, name, model) == [1.0]
        # Both prompts arrived for the prefill pool (the burst because it was backed up); one was placed there.
        assert _model_values(text, PREFILL_ARRIVALS, model) == [4000.0]
        assert _model_values(text, "ray_tandem_router_prefill_uncached_tokens_total", model) == [2000.0]
        local = [
            line
            for line in text.splitlines()
            if line.startswith("ray_tandem_router_placements_total{")
            and f'model="{model}"' in line
            and 'path="local_prefill"' in line
        ]
        assert local and local[0].endswith(" 1.0"), local
    finally:
        for request_id in ("req-burst-ahead", "req-burst 'x'; DROP"):
            await client.release(request_id)
        await fake.close()


async def test_the_replicas_ledger_publishes_on_serves_event_loop(router: RouterProcess) -> None:
    """The replica shares its state on the ledger channel (tandem.router.pubsub's raw connection,
    inside Serve's event loop, which is uvloop): its heartbeat arrives every snapshot round."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS_URL)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(f"{router.key_prefix}:router:ledger")
        deadline = time.monotonic() + 5.0
        heard = 0
        while heard < 2 and time.monotonic() < deadline:
            if await pubsub.get_message(timeout=0.5) is not None:
                heard += 1
        assert heard == 2, "no ledger message from the router replica in 5 s"
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await client.aclose()


async def test_the_replica_tags_its_ledger_messages_and_counts_forged_ones(router: RouterProcess) -> None:
    """The replica read the secret file the kit gave it (its heartbeat opens with that secret), and a
    forged message on the real channel reaches Ray's export as ray_tandem_router_ledger_rejected_total."""
    import msgspec
    import redis.asyncio as aioredis

    from tandem.router.ledger_auth import TAG_BYTES, LedgerAuth
    from tests.kit.router import LEDGER_SECRET

    channel = f"{router.key_prefix}:router:ledger"
    client = aioredis.Redis.from_url(REDIS_URL)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(channel)
        deadline = time.monotonic() + 5.0
        heartbeat = None
        while heartbeat is None and time.monotonic() < deadline:
            message = await pubsub.get_message(timeout=0.5)
            heartbeat = None if message is None else message["data"]
        assert heartbeat is not None, "no ledger message from the router replica in 5 s"
        body = LedgerAuth(LEDGER_SECRET).open_message(heartbeat)
        assert body is not None
        # The same message from another replica id (the replica drops its own unread), with a wrong tag.
        _, seq, events, sent_at_unix = msgspec.msgpack.decode(body)
        forged = msgspec.msgpack.encode(["forger", seq, events, sent_at_unix]) + bytes(TAG_BYTES)
        assert await client.publish(channel, forged) >= 1
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await client.aclose()
    deadline_s = time.monotonic() + 45  # Ray exports every ~10 s
    lines: list[str] = []
    async with httpx.AsyncClient() as http:
        while not lines and time.monotonic() < deadline_s:
            text = (await http.get(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=5)).text
            lines = [
                line
                for line in text.splitlines()
                if line.startswith("ray_tandem_router_ledger_rejected_total{") and 'reason="bad_mac"' in line
            ]
            if not lines:
                await asyncio.sleep(1)
    assert lines and lines[0].endswith(" 1.0"), lines
