"""Issue 14, promise 1: tenants and keys survive a Redis restart in the chart. Redis runs with the
chart's own arguments (rendered by helm), is killed with SIGKILL (what an OOM kill does) and started
again on the same data folder (the PVC): every tenant and every API key still works, and the lookup
the gateway does on each request finds them."""

from __future__ import annotations

import asyncio
import base64
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import yaml

from tandem.gateway.redis_client import connect
from tandem.gateway.tenancy.models import Tenant
from tandem.gateway.tenancy.store import TenantStore
from tests.chart.conftest import CHART, run_helm
from tests.faults.ledger import FaultLedger
from tests.kit.net import free_port

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

NUM_TENANTS = 20


@dataclass(frozen=True)
class ChartRedis:
    """The chart's Redis: its container arguments, and its Secret (the ACL file, each user's URL)."""

    args: list[str]
    secret: dict[str, str]

    def url(self, component: str, port: int) -> str:
        """``component``'s URL (its own Redis user), pointed at this test's port."""
        parts = urlsplit(self.secret[f"{component}-url"])
        return f"redis://{parts.username}:{parts.password}@127.0.0.1:{port}{parts.path}"


def chart_redis(key_prefix: str) -> ChartRedis:
    out = run_helm("template", "rel", str(CHART), "--set", f"redis.keyPrefix={key_prefix}").stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-tandem-redis"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert any(
        v["persistentVolumeClaim"]
        for v in deployment["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "data" and "persistentVolumeClaim" in v
    ), "the chart's Redis data is not on a PVC"
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "rel-tandem-redis"]
    data = dict(secret.get("stringData") or {})
    data.update({k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()})
    return ChartRedis([str(a) for a in container["args"]], data)


def start_redis(chart: ChartRedis, data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    # The chart's arguments, with this test's folders for the PVC and the ACL Secret, and its own port.
    args = list(chart.args)
    args[args.index("--dir") + 1] = str(data_dir)
    if "--aclfile" in args:
        acl_file = data_dir.parent / "users.acl"
        acl_file.write_text(chart.secret["users.acl"])
        args[args.index("--aclfile") + 1] = str(acl_file)
    proc = subprocess.Popen(
        ["redis-server", *args, "--port", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis.from_url(chart.url("admin", port), socket_connect_timeout=0.5)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return proc
        except redis.RedisError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("redis did not start with the chart's arguments")


async def _create(url: str, prefix: str) -> dict[str, str]:
    client = connect(url, timeout_s=2.0)
    try:
        store = TenantStore(client, key_prefix=prefix)
        keys = {}
        for i in range(NUM_TENANTS):
            tenant = await store.put_tenant(Tenant(id=f"durable-{i}", max_concurrent_streams=4))
            _, keys[tenant.id] = await store.create_key(tenant.id)
        return keys
    finally:
        await client.aclose()


async def _lookups(url: str, prefix: str, keys: dict[str, str]) -> dict[str, str]:
    client = connect(url, timeout_s=2.0)
    try:
        store = TenantStore(client, key_prefix=prefix)
        found = {}
        for tenant_id, key in keys.items():
            hit = await store.lookup_key(key)
            if hit is not None and not hit[0].revoked:
                found[tenant_id] = hit[1].cache_salt
        return found
    finally:
        await client.aclose()


def test_tenants_and_keys_survive_a_killed_redis(tmp_path: Path, ledger: FaultLedger) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found")
    port, prefix = free_port(), f"tandem-durable-{uuid.uuid4().hex[:6]}"
    chart = chart_redis(prefix)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    # As in the chart: tandem-admin writes tenants and keys as the admin user, the gateway reads them as its own.
    admin_url, gateway_url = chart.url("admin", port), chart.url("gateway", port)
    with ledger.fault("in-chart Redis SIGKILLed and restarted on its volume") as f:
        proc = start_redis(chart, data_dir, port)
        try:
            keys = asyncio.run(_create(admin_url, prefix))
            before = asyncio.run(_lookups(gateway_url, prefix, keys))
            assert len(before) == NUM_TENANTS
            time.sleep(1.5)  # appendfsync everysec: what was acknowledged over a second ago is on disk
            f.tried(NUM_TENANTS)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            proc = start_redis(chart, data_dir, port)
            after = asyncio.run(_lookups(gateway_url, prefix, keys))
            f.saw("tenants whose key still works after the restart", len(after))
            f.leaked("tenants or keys lost", NUM_TENANTS - len(after))
            # The same records: the same salts (a lost record would come back with a new one).
            assert after == before
        finally:
            proc.kill()
            proc.wait(timeout=10)
