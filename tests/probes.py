"""What the real-stack tests (integration and faults) look at: each worker's
engine and KV counters, by the stack's component name (prefill, prefill-1,
decode, decode-1), over mTLS when the stack runs it; and a small SSE reader."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis

from tandem.common.tls import channel
from tandem.local.stack import LocalStack
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc


def router_budget_tokens(stack: LocalStack) -> int:
    """Tokens every live router replica still reserves (the per-worker totals each publishes to Redis)."""
    client = redis.Redis.from_url(stack.config.redis_url, socket_timeout=2)
    try:
        total = 0
        for key in client.scan_iter(match=f"{stack.config.key_prefix}:router:replica:*"):
            raw = client.get(key)
            for value in json.loads(raw or "{}").values():
                total += value if isinstance(value, int) else int(value[0])
        return total
    finally:
        client.close()


def quota_slots(stack: LocalStack, tenant: str) -> int:
    """The gateway's concurrency slots ``tenant`` holds (one per stream in flight)."""
    client = redis.Redis.from_url(stack.config.redis_url, socket_timeout=2)
    try:
        return int(client.zcard(f"{stack.config.key_prefix}:gw:quota:{tenant}:streams"))
    finally:
        client.close()


def worker_names(stack: LocalStack, role: str | None = None) -> list[str]:
    names = list(stack.config.worker_ports())
    return [n for n in names if role is None or n.startswith(role)]


def load(stack: LocalStack, name: str) -> worker_pb2.LoadReport:
    with stack.worker_channel(name) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        report: worker_pb2.LoadReport = stub.GetLoad(worker_pb2.LoadRequest(), timeout=20)
        return report


def kv_stats(stack: LocalStack, name: str) -> kv_transfer_pb2.KVStats:
    address = f"{stack.config.host}:{stack.config.worker_ports()[name].kv_port}"
    # As a tool would: the operator's certificate (GetStats answers any component; KV itself only decode).
    with channel(address, stack.tls("operator")) as kv_channel:
        stats: kv_transfer_pb2.KVStats = kv_transfer_pb2_grpc.KVTransferStub(kv_channel).GetStats(
            kv_transfer_pb2.KVStatsRequest(), timeout=20
        )
        return stats


def gauge(stack: LocalStack, name: str, metric: str) -> float:
    """Sum of a Prometheus sample on a worker's /metrics (e.g. vllm:num_requests_running)."""
    port = stack.config.worker_ports()[name].metrics_port
    text = httpx.get(f"http://{stack.config.host}:{port}/metrics", timeout=5).text
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(metric + "{") or line.startswith(metric + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    if not seen:
        raise AssertionError(f"{metric} not exported by {name}")
    return total


@dataclass
class EngineResidue:
    """What a worker still holds: requests in its engine, KV blocks in use, blocks held for a decode,
    prefetched KV staged for a decode that has not come."""

    running: float
    waiting: float
    kv_usage_perc: float
    held_blocks: int
    staged_bytes: int = 0

    @property
    def total(self) -> float:
        return self.running + self.waiting + self.kv_usage_perc + self.held_blocks + self.staged_bytes


def residue(stack: LocalStack, name: str) -> EngineResidue:
    stats = kv_stats(stack, name)
    return EngineResidue(
        running=gauge(stack, name, "vllm:num_requests_running"),
        waiting=gauge(stack, name, "vllm:num_requests_waiting"),
        kv_usage_perc=gauge(stack, name, "vllm:kv_cache_usage_perc"),
        held_blocks=stats.num_held_blocks,
        staged_bytes=stats.staged_bytes,
    )


def wait_until(probe: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if probe():
                return True
        except Exception:
            pass
        time.sleep(interval_s)
    return False


def quiesce(stack: LocalStack, names: list[str] | None = None, *, timeout_s: float = 30.0) -> dict[str, EngineResidue]:
    """Wait for every live worker to hold nothing; return what each still holds at the end."""
    names = [n for n in (names or worker_names(stack)) if stack.is_running(n)]
    last: dict[str, EngineResidue] = {}

    def idle() -> bool:
        for n in names:
            last[n] = residue(stack, n)
        return all(r.total == 0 for r in last.values())

    wait_until(idle, timeout_s=timeout_s, interval_s=0.5)
    return last


@dataclass
class StreamResult:
    status: int
    text: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    body: str = ""

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]

    @property
    def usage(self) -> dict[str, Any] | None:
        for e in reversed(self.events):
            if e.get("usage"):
                return e["usage"]  # type: ignore[no-any-return]
        return None


def read_sse(lines: list[str]) -> StreamResult:
    result = StreamResult(status=200)
    data: list[str] = []
    for line in [*lines, ""]:
        if line.startswith("data:"):
            data.append(line[5:].lstrip())
            continue
        if line or not data:
            continue
        payload, data = "\n".join(data), []
        if payload == "[DONE]":
            result.done = True
            continue
        event = json.loads(payload)
        if "error" in event:
            result.errors.append(event["error"])
            continue
        result.events.append(event)
        for choice in event.get("choices", []):
            result.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return result
