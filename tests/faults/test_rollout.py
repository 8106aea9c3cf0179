"""Promise: a rollout to a new revision under steady load fails no request and meets no KV-layout mismatch.

A local stack (real gateway, Ray Serve router, vLLM workers on the CPU) serves one prefill and one decode
worker of the old revision (float32) while clients stream chat answers without pause. The rollout, as the
operator orders it in a cluster (tandem_operator.rollout): a prefill and a decode worker of the new revision
start together (bfloat16: another KV layout, so a handoff between revisions would be refused; declared
model revision ``v2``); once both serve, the old prefill and then the old decode worker get SIGTERM (each
unregisters, finishes what it holds and exits, as a pod does). Every request of the run must end with its
whole answer, and no worker may log a layout mismatch: the router paired only workers of one fingerprint
(tandem.router.pairing), and a new worker whose partner was not up yet took requests only as a decode
worker's local prefill, or none.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tandem.local.stack import LocalStack, WorkerPorts
from tests.faults.backend.client import chat_body, stream_chat
from tests.faults.conftest import running_stack
from tests.probes import StreamResult, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(1800)]

NUM_CLIENTS = 3
NEW_REVISION = {"TANDEM_WORKER_ENGINE__DTYPE": "bfloat16", "TANDEM_WORKER_ENGINE__MODEL_REVISION": "v2"}
#: What a worker logs when it refuses another engine's KV blocks (tandem.worker.kv_connector.layout).
MISMATCH = "cannot exchange KV blocks"
PROMPTS = ["Name three rivers in Europe.", "Überprüfe: 2 + 2 = ?", "Say hello in Japanese: こんにちは?"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with running_stack(tmp_path_factory, "rollout") as stack:
        yield stack


class Load:
    """``NUM_CLIENTS`` threads streaming chat answers back to back until stopped."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.results: list[tuple[float, StreamResult]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(NUM_CLIENTS)]

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            body = chat_body(self.stack, f"{PROMPTS[(i + n) % len(PROMPTS)]} ({i}-{n})", max_tokens=8)
            try:
                result = stream_chat(self.stack, body, timeout_s=120)
            except Exception as exc:  # a transport failure is a failed request too
                result = StreamResult(status=0, errors=[{"message": f"{type(exc).__name__}: {exc}"}])
            self.results.append((time.monotonic(), result))
            n += 1

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)

    def num_since(self, t0: float) -> int:
        return sum(1 for t, _ in self.results if t >= t0)

    @staticmethod
    def failed(result: StreamResult) -> bool:
        return result.status != 200 or bool(result.errors) or not result.done or not result.finish_reasons


def _start_workers(stack: LocalStack, names: list[str]) -> None:
    """Workers of the new revision, started together beside the running ones (both pools' surge pods, as
    the operator rolls them at once), and waited for."""
    for name in names:
        ports = WorkerPorts.free()
        extra = stack.config.extra_decode_workers if name.startswith("decode") else stack.config.extra_prefill_workers
        extra.append(ports)
        assert name in stack.config.worker_ports()
        env = {**stack._worker_env(name), **NEW_REVISION}
        stack._spawn(name, [sys.executable, "-m", "tandem.worker"], env)
    for name in names:
        stack._wait_ready(name, timeout_s=900)


def _stop_worker(stack: LocalStack, name: str) -> None:
    """SIGTERM to the worker process alone, as the kubelet sends it: it unregisters, drains, exits."""
    os.kill(stack.pid(name), signal.SIGTERM)
    assert wait_until(lambda: not stack.is_running(name), timeout_s=120), f"{name} to drain and exit"


def _records(stack: LocalStack) -> dict[int, dict[str, object]]:
    """Registered workers' records by gRPC port."""
    client = redis.Redis.from_url(stack.config.redis_url, socket_timeout=2)
    try:
        out = {}
        for key in client.scan_iter(match=f"{stack.config.key_prefix}:worker:*"):
            raw = client.get(key)
            if raw is not None:
                record = json.loads(raw)
                out[int(str(record["address"]).rpartition(":")[2])] = record
        return out
    finally:
        client.close()


def test_a_new_revision_rolls_in_under_load_with_no_failed_request(stack: LocalStack) -> None:
    old = _records(stack)
    assert len(old) == 2 and len({r["kv_fingerprint"] for r in old.values()}) == 1
    with Load(stack) as load:
        assert wait_until(lambda: load.num_since(0) >= 3, timeout_s=120), "the load to start"
        _start_workers(stack, ["decode-1", "prefill-1"])
        both = _records(stack)
        new = [r for port, r in both.items() if port not in old]
        assert len(new) == 2 and new[0]["kv_fingerprint"] == new[1]["kv_fingerprint"]
        assert {r["model_revision"] for r in new} == {"v2"}
        assert new[0]["kv_fingerprint"] != next(iter(old.values()))["kv_fingerprint"]
        overlap = time.monotonic()
        assert wait_until(lambda: load.num_since(overlap) >= 3, timeout_s=120), "requests while both serve"
        _stop_worker(stack, "prefill")
        _stop_worker(stack, "decode")
        only_new = time.monotonic()
        assert wait_until(lambda: load.num_since(only_new) >= 3, timeout_s=120), "requests on the new revision alone"
    results = [r for _, r in load.results]
    phase = {"before": overlap, "overlap": only_new}
    failed = [
        (next((k for k, end in phase.items() if t < end), "after"), r.status, r.errors, r.body[:200])
        for t, r in load.results
        if Load.failed(r)
    ]
    print(f"rollout under load: {len(results)} requests, {len(failed)} failed")
    assert failed == [], failed
    assert len(_records(stack)) == 2
    logs = {name: Path(stack.config.log_dir, f"{name}.log") for name in ("prefill", "decode", "prefill-1", "decode-1")}
    mismatches = {
        name: path.read_text(errors="replace").count(MISMATCH) for name, path in logs.items() if path.exists()
    }
    assert set(mismatches) == set(logs) and not any(mismatches.values()), mismatches
