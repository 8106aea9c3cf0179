"""Issue 43 item 5: the router's Ray head, restarted, keeps the Serve app when it runs with GCS fault
tolerance as the chart renders it.

The head is ``ray start --head --block`` in a session of its own (the head pod), its GCS kept in a real
redis-server loaded with the chart's own ACL file (rendered by helm with a key prefix of this test's): the
head logs in as the chart's ``<prefix>-raygcs`` user with the rendered password and keeps its tables under
the rendered ``externalStorageNamespace``, passed the way KubeRay passes ``gcsFaultToleranceOptions``
(``RAY_REDIS_ADDRESS``, ``RAY_external_storage_namespace``, ``--redis-username`` / ``--redis-password``;
the address is this Redis's instead of the in-cluster Service's). Tandem's router app is deployed on it
the way the local stack deploys it (``python -m tandem.router`` with ``TANDEM_ROUTER_RAY_ADDRESS``), and
that driver is then SIGKILLed: as under KubeRay, nothing outside the cluster holds the app. Fake workers
heartbeat into the registry (the real Redis on 6379, under a prefix of this test's).

The fault: every process of the head (GCS, raylet, the Serve controller, proxy and router replica) is
SIGKILLed, as when the head pod is OOM-killed or its node is lost, and the head is started again with the
same settings. With fault tolerance the restarted GCS restarts the detached Serve controller, which
redeploys the app from its checkpoint: a Schedule is answered again, with nobody redeploying anything.
Without it (the control, ``router.gcsFaultTolerance.enabled=false``) the new head is an empty cluster.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import yaml

from tandem.common.errors import BackendUnavailableError, TandemError
from tandem.common.registry import WorkerRecord, WorkerRegistry
from tandem.common.router_client import RouterClient
from tests.chart.conftest import CHART, RELEASE, one, run_helm
from tests.faults.ledger import FaultLedger
from tests.kit.net import free_port
from tests.kit.ray_head import head_processes
from tests.kit.redis import start_redis
from tests.kit.router import router_process

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

REGISTRY_URL = "redis://127.0.0.1:6379/0"
RAY = str(Path(sys.executable).parent / "ray")
#: A head and the app's controller, proxy and replica restarted on a loaded 2-core host.
RECOVERY_TIMEOUT_S = 300.0
#: How long the control waits for an app that should not come back.
CONTROL_WAIT_S = 60.0
MODEL = "smol-ft"
#: Every Ray process of the test, as in the chart's pods: token authentication on (``ray.auth.mode: token``,
#: the chart's default), the token in the environment as KubeRay's ``authOptions`` sets it from its Secret
#: (32 random bytes, base64), so the restarted head and the app's processes must all carry it.
RAY_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": base64.b64encode(secrets.token_bytes(32)).decode()}


def _rendered(key_prefix: str, enabled: bool) -> tuple[dict[str, object] | None, dict[str, str]]:
    """The chart's gcsFaultToleranceOptions (None when off) and its Redis Secret's stringData."""
    sets = [f"redis.keyPrefix={key_prefix}", f"router.gcsFaultTolerance.enabled={str(enabled).lower()}"]
    out = run_helm(
        "template", RELEASE, str(CHART), "--namespace", "tandem", *[arg for s in sets for arg in ("--set", s)]
    ).stdout
    docs = tuple(d for d in yaml.safe_load_all(out) if d)
    cluster = one(docs, "RayService", f"{RELEASE}-tandem-router")["spec"]["rayClusterConfig"]
    secret = one(docs, "Secret", f"{RELEASE}-tandem-redis")["stringData"]
    return cluster.get("gcsFaultToleranceOptions"), secret


@dataclass
class Head:
    """The head "pod": ``ray start --head --block`` and everything it starts, in a session of its own."""

    args: list[str]
    env: dict[str, str]
    temp_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    #: With GCS FT: the Redis it keeps its tables in, logged in as the head is (the chart's raygcs user).
    gcs_redis: redis.Redis | None = None
    #: Times :meth:`keep_running` started it again.
    restarts: int = 0
    started_lines_before: int = 0

    def start(self) -> None:
        self.started_lines_before = self._started_lines()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def keep_running(self) -> None:
        """The kubelet's ``restartPolicy: Always``: a head whose ``ray start`` exited (on a loaded host, its
        raylet may miss Ray's fixed 30 s to register with the GCS) is started again, its leftovers killed."""
        if self.proc is not None and self.proc.poll() is not None:
            self.kill()
            self.restarts += 1
            self.start()

    def wait_started(self, timeout_s: float) -> None:
        """Until ``ray start`` says the runtime started (restarted as the kubelet would, meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._started_lines() > self.started_lines_before:
                return
            self.keep_running()
            time.sleep(0.5)
        raise AssertionError(f"the head did not start in {timeout_s:.0f} s:\n{self.log_tail()}")

    def _started_lines(self) -> int:
        return self.log_path.read_text(errors="replace").count("Ray runtime started") if self.log_path.exists() else 0

    def processes(self) -> list[int]:
        return head_processes(None if self.proc is None else self.proc.pid, self.temp_dir)

    def kill(self) -> int:
        """SIGKILL every process of the head at once (its pod dies); the number killed."""
        pids = self.processes()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not self.processes(), f"head processes left: {self.processes()}"
        return len(pids)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def _ray_ports() -> list[str]:
    # Ray's worker ports: a range of their own, below free_port()'s and above where other Rays' workers start.
    base = random.randrange(16000, 19800, 200)
    ports = [
        ("--node-manager-port", free_port()), ("--object-manager-port", free_port()),
        ("--dashboard-agent-listen-port", free_port()), ("--dashboard-agent-grpc-port", free_port()),
        ("--metrics-export-port", free_port()), ("--runtime-env-agent-port", free_port()),
        ("--ray-client-server-port", free_port()), ("--min-worker-port", base), ("--max-worker-port", base + 199),
    ]  # fmt: skip
    return [arg for name, port in ports for arg in (name, str(port))]


@contextlib.contextmanager
def ray_head(tmp: Path, options: dict[str, object] | None, secret: dict[str, str]) -> Iterator[Head]:
    """A head on a free port; with ``options`` (the chart's gcsFaultToleranceOptions) its GCS in a private
    redis-server loaded with the chart's ACL file, passed as KubeRay passes them."""
    temp_dir = Path(f"/tmp/tandem-ft-{uuid.uuid4().hex[:8]}")  # Ray's socket paths must stay short
    gcs_port = free_port()
    args = [
        RAY,
        "start",
        "--head",
        "--block",
        "--port",
        str(gcs_port),
        "--num-cpus",
        "2",
        "--include-dashboard",
        "false",
        "--disable-usage-stats",
        "--temp-dir",
        str(temp_dir),
        *_ray_ports(),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | RAY_ENV
    env["RAY_agent_register_timeout_ms"] = "180000"  # a loaded host (tandem.router.__main__ does the same)
    redis_proc = None
    if options is not None:
        acl = tmp / "users.acl"
        acl.write_text(secret["users.acl"])
        redis_port = free_port()
        redis_proc = start_redis(redis_port, "--aclfile", str(acl))
        env["RAY_REDIS_ADDRESS"] = f"127.0.0.1:{redis_port}"  # the rendered redisAddress is the Service's
        env["RAY_external_storage_namespace"] = str(options["externalStorageNamespace"])
        username = options["redisUsername"]
        assert isinstance(username, dict) and options["redisPassword"]  # the chart's Redis has auth on
        args += ["--redis-username", str(username["value"]), "--redis-password", secret["raygcs-password"]]
    head = Head(args, env, temp_dir, tmp / "ray-head.log")
    if redis_proc is not None:
        head.gcs_redis = redis.Redis(
            port=redis_port, username=str(username["value"]), password=secret["raygcs-password"]
        )
    try:
        head.start()
        head.wait_started(RECOVERY_TIMEOUT_S)
        yield head
    finally:
        head.kill()
        if redis_proc is not None:
            assert head.gcs_redis is not None
            head.gcs_redis.close()
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def heartbeating(key_prefix: str) -> AsyncIterator[list[WorkerRecord]]:
    """A prefill and a decode worker record kept alive in the registry, as real workers keep theirs."""
    registry = WorkerRegistry(REGISTRY_URL, key_prefix=key_prefix, ttl_s=30.0)
    records = [
        WorkerRecord(worker_id="ft-prefill-0", role="prefill", model=MODEL, address="127.0.0.1:7301"),
        WorkerRecord(worker_id="ft-decode-0", role="decode", model=MODEL, address="127.0.0.1:7302"),
    ]

    async def beat() -> None:
        while True:
            for record in records:
                await registry.heartbeat(record)
            await asyncio.sleep(2.0)

    task = asyncio.create_task(beat())
    try:
        yield records
    finally:
        task.cancel()
        for record in records:
            await registry.unregister(record.worker_id)
        await registry.aclose()
        client = redis.Redis.from_url(REGISTRY_URL)  # the unregistering wrote after router_process cleaned up
        keys = list(client.scan_iter(f"{key_prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


async def _schedule(address: str, request_id: str) -> tuple[str, str]:
    async with RouterClient(address, timeout_s=5.0) as client:
        placement = await client.schedule(request_id, MODEL, num_prompt_tokens=2000, max_tokens=8)
        released = await client.release(request_id)
    assert released, request_id
    return placement.prefill.worker_id, placement.decode.worker_id


async def _answered_within(address: str, head: Head, timeout_s: float) -> float | None:
    """Seconds until a Schedule is answered (tried every 2 s), or None; the head kept running meanwhile."""
    started = time.monotonic()
    attempt = 0
    while time.monotonic() - started < timeout_s:
        head.keep_running()
        attempt += 1
        try:
            await _schedule(address, f"after-restart-{attempt}")
            return time.monotonic() - started
        except TandemError:  # unreachable, no application yet, a replica starting: all "not yet"
            await asyncio.sleep(2.0)
    return None


def _serve_status(ray_address: str) -> dict[str, object]:
    """The Serve app as a new driver sees it (serve.status(), through the controller)."""
    code = (
        "import json, ray\n"
        f"ray.init(address={ray_address!r}, logging_level='ERROR', log_to_driver=False)\n"
        "from ray import serve\n"
        "s = serve.status()\n"
        "apps = {n: {'status': str(a.status.value if hasattr(a.status, 'value') else a.status),\n"
        "            'deployments': {d: {k: int(v) for k, v in dep.replica_states.items()}\n"
        "                            for d, dep in a.deployments.items()}} for n, a in s.applications.items()}\n"
        "print('STATUS ' + json.dumps(apps))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | RAY_ENV
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STATUS ")), None)
    assert line is not None, f"serve.status() failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    status: dict[str, object] = json.loads(line.removeprefix("STATUS "))
    return status


@pytest.mark.parametrize("fault_tolerant", [True, False], ids=["gcs-ft", "control-without-ft"])
async def test_a_head_restart_keeps_the_router_app_with_gcs_fault_tolerance(
    fault_tolerant: bool, tmp_path: Path, ledger: FaultLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)  # the router's driver (router_process passes the environment on)
    try:
        redis.Redis.from_url(REGISTRY_URL, socket_connect_timeout=1).ping()
    except redis.RedisError:
        pytest.skip(f"Redis not reachable at {REGISTRY_URL}")
    key_prefix = f"tandem-test-ft-{uuid.uuid4().hex[:8]}"
    options, secret = _rendered(key_prefix, fault_tolerant)
    assert (options is not None) == fault_tolerant
    name = "router head restart, GCS fault tolerance" if fault_tolerant else "router head restart, no GCS FT (control)"
    with ledger.fault(name) as fault, ray_head(tmp_path, options, secret) as head:
        ray_address = f"127.0.0.1:{head.args[head.args.index('--port') + 1]}"
        async with heartbeating(key_prefix) as records:
            with router_process(tmp_path, REGISTRY_URL, key_prefix=key_prefix, RAY_ADDRESS=ray_address,
                                NUM_REPLICAS="1") as router:  # fmt: skip
                names = {r.worker_id for r in records}
                assert set(await _schedule(router.address, "before-restart")) == names
                router.proc.kill()  # the driver is gone for good: under KubeRay nothing outside holds the app
                router.proc.wait(timeout=30)
                await asyncio.sleep(1.0)
                assert set(await _schedule(router.address, "driver-gone")) == names

                killed = head.kill()
                fault.tried()
                killed_at = time.monotonic()
                with pytest.raises(BackendUnavailableError):
                    await _schedule(router.address, "head-down")  # the kill was real: nothing answers
                head.start()
                if fault_tolerant:
                    took_s = await _answered_within(router.address, head, RECOVERY_TIMEOUT_S)
                    assert took_s is not None, f"no answer {RECOVERY_TIMEOUT_S:.0f} s after the restart:\n" + (
                        head.log_tail()
                    )
                    down_s = time.monotonic() - killed_at
                    assert set(await _schedule(router.address, "steady")) == names
                    status = _serve_status(ray_address)
                    app = status.get("tandem-router")
                    assert isinstance(app, dict) and app["status"] == "RUNNING", status
                    (replicas,) = app["deployments"].values()
                    assert replicas == {"RUNNING": 1}, status  # one replica, as deployed: none doubled, none lost
                    # Where the chart says: Ray's hashes under the rendered namespace, the Serve checkpoint among them.
                    assert head.gcs_redis is not None and options is not None
                    tables = {
                        k.decode() for k in head.gcs_redis.scan_iter(f"RAY{options['externalStorageNamespace']}@*")
                    }
                    assert f"RAY{options['externalStorageNamespace']}@KV" in tables, tables
                    fault.saw(f"Schedule answered again {down_s:.0f} s after {killed} head processes were killed")
                    print(f"head restart: {killed} processes killed, answered again after {down_s:.1f} s "
                          f"({head.restarts} more head restarts); {status}")  # fmt: skip
                else:
                    took_s = await _answered_within(router.address, head, CONTROL_WAIT_S)
                    assert took_s is None, "the app came back without GCS fault tolerance"
                    status = _serve_status(ray_address)
                    assert "tandem-router" not in status, status
                    fault.saw(f"no answer {CONTROL_WAIT_S:.0f} s after the restart, no app: {status}")
