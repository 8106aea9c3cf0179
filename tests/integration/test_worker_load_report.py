"""The load fields the router scores on come from the real worker: while an answer streams, the
decode worker's registry record (its heartbeat) and its GetLoad carry the KV usage vLLM itself
reports, and the router's budget reads that record as the worker's KV fullness."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tandem.common.registry import WorkerRecord, WorkerRegistry
from tandem.local.stack import LocalStack
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.reservations import ReservationTable
from tests.probes import load

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


async def _decode_record(stack: LocalStack) -> WorkerRecord:
    registry = WorkerRegistry(stack.config.redis_url, key_prefix=stack.config.key_prefix)
    try:
        (record,) = await registry.list_workers(role="decode")
        return record
    finally:
        await registry.aclose()


def test_a_streaming_answer_shows_in_the_decode_workers_reported_kv_usage(stack: LocalStack) -> None:
    body = {
        "model": stack.config.served_model_name,
        "prompt": "Tell a long story about a lighthouse keeper in Kyōto 🏮. " * 8,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    done, stop = threading.Event(), threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=stack.config.gateway_url, headers=stack.auth_headers, timeout=300) as client:
            with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for _ in resp.iter_lines():
                    if stop.is_set():
                        break  # the client leaves: the answer is aborted
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    record = None
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        record = asyncio.run(_decode_record(stack))
        if record.load.kv_usage > 0:
            break
        time.sleep(0.3)
    assert record is not None and record.load.kv_usage > 0, record
    report = load(stack, "decode")
    # The same number vLLM exports: the worker reads its engine's own gauge.
    assert report.num_kv_blocks_total == record.num_kv_blocks > 0
    assert 0 < record.load.kv_usage <= 1
    # The router's consumer: KV fullness of a decode worker is at least what the worker reports.
    view = BudgetView(ReservationTable(lease_s=60), BudgetConfig())
    assert view.kv_fullness(record) >= record.load.kv_usage
    stop.set()
    assert done.wait(timeout=60)
