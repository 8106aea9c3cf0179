"""Issue 43, Ray's token authentication as the chart turns it on: a real Ray 2.60 head started the way KubeRay
starts the router's head when the rendered RayService carries ``authOptions: {mode: token}`` (the env
``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` from the Secret, a token shaped as KubeRay generates one),
with its dashboard and GCS on free ports, a temp dir and a HOME of its own.

Refused without the token: a driver's ``ray.init`` (no token, or a wrong one), and the dashboard's Jobs API
(a job submitted without the token never runs). With the token, as KubeRay sends it (``x-ray-authorization``),
the dashboard takes the chart's rendered ``serveConfigV2`` (its ports moved to free ones, one replica), the
router app deploys from ``tandem_router_app:app`` as in the router image, and answers the gateway's Schedule
and Release through Serve's gRPC proxy, which asks for no token; nor do the probes' health paths and Ray's
metrics export (Prometheus and the operator's ``source: router``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from tandem.common.registry import WorkerRecord, WorkerRegistry
from tandem.common.router_client import RouterClient
from tests.chart.conftest import ROOT, one, render
from tests.kit.net import free_port
from tests.kit.ray_head import head_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

REDIS_URL = "redis://127.0.0.1:6379/0"
RAY = str(Path(sys.executable).parent / "ray")
STARTUP_TIMEOUT_S = 240.0
MODEL = "smol-auth"
#: A token as KubeRay 1.6 generates one (base64 of 32 random bytes: '+', '/' and '=' included).
TOKEN = base64.b64encode(secrets.token_bytes(32)).decode()


def _rendered_cluster() -> dict[str, Any]:
    cluster: dict[str, Any] = one(render(None), "RayService", "rel-tandem-router")["spec"]
    return cluster


@dataclass
class Head:
    gcs: str
    dashboard: str
    metrics_port: int
    grpc_port: int
    key_prefix: str
    home: Path
    temp_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes]

    def processes(self) -> list[int]:
        return head_processes(self.proc.pid, self.temp_dir)

    def stop(self) -> None:
        """SIGTERM then SIGKILL to this head's processes only (never a global ``ray stop``)."""
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 15.0)):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while self.proc.poll() is None or self.processes():  # poll(): reap ``ray start``, our child
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert not self.processes(), f"head processes left: {self.processes()}"


def _pod_env(cluster: dict[str, Any], key_prefix: str, secret_file: Path, home: Path) -> dict[str, str]:
    """The head container's environment as KubeRay gives it: the chart's plain values, the Secret's values
    (here: the local Redis, a ledger secret file), and what authOptions makes KubeRay add."""
    auth = cluster["rayClusterConfig"]["authOptions"]
    assert auth == {"mode": "token"}, auth  # KubeRay's own generated Secret: it sets both variables below
    (container,) = [c for c in cluster["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
                    if c["name"] == "ray-head"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TANDEM_"))}
    env |= {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env |= {
        "HOME": str(home),  # the chart's HOME=/tmp: no ~/.ray/auth_token there
        "TANDEM_ROUTER_REDIS__URL": REDIS_URL,
        "TANDEM_ROUTER_REGISTRY__KEY_PREFIX": key_prefix,
        "TANDEM_ROUTER_LEDGER__SECRET_FILE": str(secret_file),
        "PYTHONPATH": str(ROOT / "docker" / "router"),  # tandem_router_app, as the router image installs it
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": TOKEN,
        "RAY_agent_register_timeout_ms": "180000",  # a loaded 2-core host
    }
    return env


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError:
        pytest.skip(f"Redis not reachable at {REDIS_URL}")
    tmp = tmp_path_factory.mktemp("ray-auth")
    home = tmp / "home"
    home.mkdir()
    secret_file = tmp / "ledger-secret"
    secret_file.write_bytes(secrets.token_bytes(32))
    secret_file.chmod(0o600)
    key_prefix = f"tandem-test-rayauth-{uuid.uuid4().hex[:8]}"
    env = _pod_env(_rendered_cluster(), key_prefix, secret_file, home)
    grpc_port = free_port()
    env["TANDEM_ROUTER_GRPC_PORT"] = str(grpc_port)
    temp_dir = Path(f"/tmp/tandem-rayauth-{uuid.uuid4().hex[:8]}")  # Ray's socket paths must stay short
    gcs_port, dashboard_port, metrics_port = free_port(), free_port(), free_port()
    base = random.randrange(16000, 19800, 200)  # Ray's worker ports: below free_port()'s range
    ports = {
        "--port": gcs_port, "--dashboard-port": dashboard_port, "--metrics-export-port": metrics_port,
        "--node-manager-port": free_port(), "--object-manager-port": free_port(),
        "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(), "--ray-client-server-port": free_port(),
        "--min-worker-port": base, "--max-worker-port": base + 199,
    }  # fmt: skip
    args = [RAY, "start", "--head", "--block", "--num-cpus", "2", "--disable-usage-stats",
            "--dashboard-host", "127.0.0.1", "--temp-dir", str(temp_dir),
            *[a for name, port in ports.items() for a in (name, str(port))]]  # fmt: skip
    log_path = tmp / "ray-head.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started = Head(
        f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dashboard_port}", metrics_port, grpc_port,
        key_prefix, home, temp_dir, log_path, proc,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _dashboard_up(started):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not start:\n{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        yield started
    finally:
        started.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{key_prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def _dashboard_up(head: Head) -> bool:
    try:
        return httpx.get(f"{head.dashboard}/api/gcs_healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _driver(head: Head, auth_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``ray.init(address=<the GCS>)`` in a subprocess with ``auth_env`` as its only Ray variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(head.home)} | auth_env
    code = f"import ray\nray.init(address={head.gcs!r}, log_to_driver=False)\nprint('CONNECTED', len(ray.nodes()))\n"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def _bearer(token: str) -> dict[str, str]:
    return {"x-ray-authorization": f"Bearer {token}"}  # KubeRay's dashboard client's header


def test_a_driver_without_the_token_is_refused(head: Head) -> None:
    wrong = TOKEN[:-4] + ("AAA=" if not TOKEN.endswith("AAA=") else "BBB=")
    for auth_env in ({}, {"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": wrong}):
        result = _driver(head, auth_env)
        assert result.returncode != 0 and "CONNECTED" not in result.stdout, (auth_env.keys(), result)
        assert "InvalidAuthToken" in result.stderr, result.stderr[-2000:]  # the GCS refused it, nothing else
    result = _driver(head, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN})
    assert result.returncode == 0 and "CONNECTED 1" in result.stdout, result  # the control


def test_the_jobs_api_refuses_without_the_token(head: Head, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    job = {"entrypoint": f"touch {marker}", "submission_id": f"hostile-'\"; ☃-{uuid.uuid4().hex[:6]}"}
    with httpx.Client(base_url=head.dashboard, timeout=30.0) as http:
        assert http.post("/api/jobs/", json=job).status_code == 401
        assert http.post("/api/jobs/", json=job, headers={"Authorization": "Bearer nope"}).status_code == 403
        assert http.post("/api/jobs/", json=job, headers=_bearer(TOKEN[:-1])).status_code == 403
        assert http.get("/api/jobs/").status_code == 401
        assert http.get("/api/serve/applications/").status_code == 401
        # KubeRay's probes and Ray's own health paths stay open.
        assert http.get("/api/gcs_healthz").status_code == 200
        listed = http.get("/api/jobs/", headers=_bearer(TOKEN))
        assert listed.status_code == 200
        assert [j for j in listed.json() if j["type"] != "DRIVER"] == []  # drivers: the control's, if it ran
    time.sleep(1.0)
    assert not marker.exists()


def test_with_the_token_the_charts_serve_app_deploys_and_answers(head: Head) -> None:
    config = yaml.safe_load(_rendered_cluster()["serveConfigV2"])
    config["http_options"] = {"host": "127.0.0.1", "port": free_port()}
    config["grpc_options"]["port"] = head.grpc_port
    (app,) = config["applications"]
    app["args"]["num_replicas"] = 1  # two cores
    with httpx.Client(base_url=head.dashboard, timeout=60.0) as http:
        assert http.put("/api/serve/applications/", json=config).status_code == 401
        deployed = http.put("/api/serve/applications/", json=config, headers=_bearer(TOKEN))
        assert deployed.status_code == 200, deployed.text
        deadline, status = time.monotonic() + STARTUP_TIMEOUT_S, ""
        while status != "RUNNING":
            apps = http.get("/api/serve/applications/", headers=_bearer(TOKEN)).json()["applications"]
            status = apps.get(app["name"], {}).get("status", "")
            assert status not in ("DEPLOY_FAILED", "UNHEALTHY"), apps[app["name"]]
            assert time.monotonic() < deadline, f"{status}:\n{head.log_path.read_text(errors='replace')[-3000:]}"
            time.sleep(1.0)
    registry = WorkerRegistry(REDIS_URL, key_prefix=head.key_prefix, ttl_s=60.0)
    records = [
        WorkerRecord(worker_id="auth-p0", role="prefill", model=MODEL, address="127.0.0.1:7401"),
        WorkerRecord(worker_id="auth-d0", role="decode", model=MODEL, address="127.0.0.1:7402"),
    ]
    placements = asyncio.run(_schedule_a_few(f"127.0.0.1:{head.grpc_port}", registry, records))
    assert placements == [("auth-p0", "auth-d0")] * 3
    # Ray's metrics export, as Prometheus and the operator read it: no token, the router's series there.
    metrics = httpx.get(f"http://127.0.0.1:{head.metrics_port}/metrics", timeout=10.0)
    assert metrics.status_code == 200 and "ray_" in metrics.text


async def _schedule_a_few(address: str, registry: WorkerRegistry, records: list[WorkerRecord]) -> list[tuple[str, str]]:
    """The gateway's calls, with no Ray token: a few Schedules and Releases once the router sees the workers."""
    for record in records:
        await registry.heartbeat(record)
    placements = []
    try:
        async with RouterClient(address, timeout_s=10.0) as client:
            deadline = time.monotonic() + 60.0
            while True:  # the replica reads the registry every half second
                try:
                    await client.schedule("auth-warmup", MODEL, num_prompt_tokens=2000, max_tokens=8)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            await client.release("auth-warmup")
            for i in range(3):
                placement = await client.schedule(f"auth-{i}", MODEL, num_prompt_tokens=2000, max_tokens=8)
                placements.append((placement.prefill.worker_id, placement.decode.worker_id))
                assert await client.release(f"auth-{i}") is True
    finally:
        for record in records:
            await registry.unregister(record.worker_id)
        await registry.aclose()
    return placements
