"""One stack for the back-end faults: two prefill and two decode workers (real
vLLM engines), the Ray Serve router, the gateway, and a private Redis that
keeps its data in an append-only file (so a killed Redis comes back with its
tenants and keys, as a production Redis does).

Short leases and pull timeouts bound how long a fault may take to heal; the
failpoints folder lets a test stall a prefill worker's KV server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tandem.local.stack import LocalStack, free_port
from tests.faults.conftest import running_stack
from tests.probes import wait_until, worker_names

#: Bounds the fault tests rely on (and the stack is started with).
KV_LEASE_S = 20.0
PULL_TIMEOUT_S = 8.0
REGISTRY_TTL_S = 5.0
#: A gateway replica silent this long is dead, and its in-flight requests are billed by another.
GATEWAY_LIVENESS_S = 3.0
#: Tokens a stream may send beyond what its open usage record holds (small here, so that the bound bites
#: within a test's answer; the default is 256).
USAGE_MAX_UNSAVED_TOKENS = 8
#: The longest reconnect backoff of Tandem's gRPC clients (gateway → workers, decode → prefill KV).
RECONNECT_BACKOFF_S = 2.5


class BackendStack:
    """The stack plus where its failpoints live."""

    def __init__(self, stack: LocalStack, failpoints_dir: Path) -> None:
        self.stack = stack
        self.failpoints_dir = failpoints_dir

    def arm(self, failpoint: str, action: str) -> None:
        (self.failpoints_dir / failpoint).write_text(action)

    def disarm_all(self) -> None:
        for path in self.failpoints_dir.iterdir():
            path.unlink()

    def registered(self) -> set[str]:
        """Names of the workers with a live registration in Redis."""
        return registered_workers(self.stack)


def registered_workers(stack: LocalStack) -> set[str]:
    by_port = {ports.port: name for name, ports in stack.config.worker_ports().items()}
    client = redis.Redis.from_url(stack.config.redis_url, socket_timeout=2)
    try:
        names = set()
        for key in client.scan_iter(match=f"{stack.config.key_prefix}:worker:*"):
            raw = client.get(key)
            if raw is None:
                continue
            port = int(json.loads(raw)["address"].rpartition(":")[2])
            if port in by_port:
                names.add(by_port[port])
        return names
    finally:
        client.close()


@pytest.fixture(scope="package")
def backend_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendStack]:
    failpoints = Path(tmp_path_factory.mktemp("failpoints"))
    with running_stack(
        tmp_path_factory,
        "backend",
        num_prefill_workers=2,
        num_decode_workers=2,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        redis_data_dir=Path(tmp_path_factory.mktemp("redis-data")),
        kv_lease_s=KV_LEASE_S,
        extra_env={
            "TANDEM_FAILPOINTS_DIR": str(failpoints),
            "TANDEM_WORKER_KV__PULL_TIMEOUT_S": str(PULL_TIMEOUT_S),
            "TANDEM_WORKER_REGISTRY__TTL_S": str(REGISTRY_TTL_S),
            "TANDEM_GATEWAY_TENANCY__USAGE_LIVENESS_S": str(GATEWAY_LIVENESS_S),
            "TANDEM_GATEWAY_TENANCY__USAGE_SWEEP_INTERVAL_S": "1",
            "TANDEM_GATEWAY_TENANCY__USAGE_MAX_UNSAVED_TOKENS": str(USAGE_MAX_UNSAVED_TOKENS),
        },
    ) as stack:
        yield BackendStack(stack, failpoints)


@pytest.fixture
def backend(backend_stack: BackendStack) -> BackendStack:
    """The back-end stack whole again before each test: what an earlier test killed is restarted,
    failpoints are disarmed and every worker is registered."""
    stack = backend_stack.stack
    backend_stack.disarm_all()
    restarted = False
    for name in ["redis", "router", *worker_names(stack), "gateway"]:
        if name in stack.components and not stack.is_running(name):
            stack.restart(name)
            restarted = True
    everyone = set(worker_names(stack))
    assert wait_until(lambda: backend_stack.registered() == everyone, timeout_s=60), backend_stack.registered()
    if restarted:
        # The gateway's and the engines' channels to a restarted address redial within 2 s (their
        # reconnect backoff); a test that kills another worker at once would otherwise see two faults.
        time.sleep(RECONNECT_BACKOFF_S)
    return backend_stack
