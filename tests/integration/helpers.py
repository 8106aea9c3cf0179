"""Small clients the integration tests share: SSE parsing, worker counters,
worker Prometheus gauges."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from tandem.local.stack import LocalStack
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc


@dataclass
class SSEResult:
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False

    @property
    def text(self) -> str:
        out = []
        for ev in self.events:
            for choice in ev.get("choices", []):
                delta = choice.get("delta") or {}
                out.append(delta.get("content") or choice.get("text") or "")
        return "".join(out)


def parse_sse(raw: str) -> SSEResult:
    result = SSEResult()
    for block in raw.split("\n\n"):
        data = [line[5:].lstrip() for line in block.splitlines() if line.startswith("data:")]
        if not data:
            continue
        payload = "\n".join(data)
        if payload == "[DONE]":
            result.done = True
        else:
            result.events.append(json.loads(payload))
    return result


def load(stack: LocalStack, role: str) -> worker_pb2.LoadReport:
    port = stack.config.prefill_port if role == "prefill" else stack.config.decode_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.LoadRequest(), timeout=5)


def kv_stats(stack: LocalStack, role: str, request_id: str = "") -> kv_transfer_pb2.KVStats:
    port = stack.config.prefill_kv_port if role == "prefill" else stack.config.decode_kv_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return kv_transfer_pb2_grpc.KVTransferStub(channel).GetStats(
            kv_transfer_pb2.KVStatsRequest(request_id=request_id), timeout=5
        )


def worker_gauge(stack: LocalStack, role: str, name: str) -> float:
    """Sum of a Prometheus sample on a worker's /metrics (e.g. vllm:num_requests_running)."""
    port = stack.config.prefill_metrics_port if role == "prefill" else stack.config.decode_metrics_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    if not seen:
        raise AssertionError(f"{name} not exported by the {role} worker")
    return total
