"""Active-active router replicas for real: ``python -m tandem.router`` with two
Serve replicas, SIMULATED workers (registry + KV events), RouterClient as the
gateway uses it. One replica process is killed (SIGKILL) while requests keep
coming; every request the gateway can retry must still be placed.

Heavy (Ray): one router per module, a few minutes at most on a busy 2-core box.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from tandem.common.errors import RetryableError
from tandem.common.router_client import RouterClient
from tandem.local.simulated_worker import SimulatedCluster, SimulatedLatencyModel, SimulatedWorkerConfig
from tests.integration.test_router_ray import REDIS_URL, redis_is_up
from tests.kit.router import RouterProcess, router_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(400)]

MODEL = "simulated-model"
REPLICA_TITLE = "ServeReplica:tandem-router:Router"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    if not redis_is_up():
        pytest.skip(f"Redis not reachable at {REDIS_URL}")
    with router_process(
        tmp_path_factory.mktemp("router-failover"),
        REDIS_URL,
        key_prefix=f"tandem-test-failover-{uuid.uuid4().hex[:8]}",
        NUM_REPLICAS="2",
    ) as process:
        yield process


@pytest_asyncio.fixture
async def cluster(router: RouterProcess) -> AsyncIterator[SimulatedCluster]:
    configs = [
        SimulatedWorkerConfig(
            worker_id=f"simulated-{role}-{i}",
            role=role,
            model=MODEL,
            latency=SimulatedLatencyModel(time_scale=0.0),
            serve_grpc=False,
        )
        for role in ("prefill", "decode")
        for i in range(2)
    ]
    c = SimulatedCluster(configs, redis_url=REDIS_URL, key_prefix=router.key_prefix)
    await c.start()
    await asyncio.sleep(1.0)  # past the router's registry refresh
    yield c
    await c.aclose()


def replica_pids(root_pid: int) -> list[int]:
    """Serve replica processes of our router (Ray names them ray::ServeReplica:<app>:<deployment>)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if REPLICA_TITLE in cmdline and _descends_from(int(entry), root_pid):
            pids.append(int(entry))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _descends_from(pid: int, root_pid: int) -> bool:
    for _ in range(20):
        if pid == root_pid:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return False
    return False


async def schedule_with_retries(client: RouterClient, request_id: str, errors: Counter[str]) -> str:
    """What the gateway does with a retryable router error: try again, a few times."""
    for attempt in range(8):
        try:
            placement = await client.schedule(request_id, MODEL, prompt_token_ids=[1] * 300, max_tokens=16)
            # The worker that computes the prompt: the decode worker itself for a local prefill (these requests
            # are never released, so the prefill workers back up and the router runs some on a decode worker
            # with room: tandem.router.burst).
            return placement.prefill.worker_id or placement.decode.worker_id
        except RetryableError as exc:
            errors[type(exc).__name__] += 1
            await asyncio.sleep(min(2.0, 0.25 * 2**attempt))
    raise AssertionError(f"{request_id} never placed; errors {errors}")


async def test_killing_one_replica_loses_no_retryable_request(router: RouterProcess, cluster: SimulatedCluster) -> None:
    pids = replica_pids(router.proc.pid)
    assert len(pids) == 2, f"expected two replica processes, found {pids}"
    errors: Counter[str] = Counter()
    async with RouterClient(router.address, timeout_s=10.0) as client:
        before = [await schedule_with_retries(client, f"before-{i}", errors) for i in range(20)]
        assert set(before) <= {w.config.worker_id for w in cluster.workers}

        async def stream(prefix: str, n: int) -> list[str]:
            calls = (schedule_with_retries(client, f"{prefix}-{i}", errors) for i in range(n))
            return list(await asyncio.gather(*calls))

        async def steady(prefix: str, n: int, interval_s: float) -> list[str]:
            """A request every ``interval_s``, each retried like the gateway would."""
            tasks = []
            for i in range(n):
                tasks.append(asyncio.create_task(schedule_with_retries(client, f"{prefix}-{i}", errors)))
                await asyncio.sleep(interval_s)
            return list(await asyncio.gather(*tasks))

        during = asyncio.create_task(steady("during", 150, 0.02))  # ~3 s of traffic
        await asyncio.sleep(0.7)
        os.kill(pids[0], signal.SIGKILL)  # a replica we started (through our router process)
        killed_at = time.monotonic()
        placed = await asyncio.wait_for(during, 180)
        assert len(placed) == 150
        assert not _alive(pids[0])
        print(f"150 requests placed around the kill; the last {time.monotonic() - killed_at:.1f} s after it")
        after = await stream("after", 20)
        assert len(after) == 20
        # Releases of requests placed by the dead replica answer, whichever replica gets them.
        for i in range(20):
            await client.release(f"before-{i}")
    started = time.monotonic()
    while len(replica_pids(router.proc.pid)) < 2 and time.monotonic() - started < 60:
        await asyncio.sleep(1)  # Serve replaces the dead replica
    print(f"retryable errors while a replica died: {dict(errors)}")
    assert set(errors) <= {"BackendUnavailableError", "NoCapacityError", "WorkerUnavailableError"}
