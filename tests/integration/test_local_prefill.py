"""Disaggregate only when it pays, on the real stack: a prompt whose prefix the decode worker
already holds (it loaded that KV for an earlier request; its KV events told the router) is
finished on the decode worker alone, with no prefill call and no KV pull, and answers exactly as
the handoff did.

The stack's threshold is ``MIN_UNCACHED_TOKENS_TO_DISAGGREGATE`` (conftest.py): a prompt of two
KV blocks plus a few tokens goes through the handoff the first time (all of it is uncached), and
the second time only those few tokens are missing on the decode worker."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tandem.local.stack import LocalStack
from tests.integration.conftest import MIN_UNCACHED_TOKENS_TO_DISAGGREGATE
from tests.probes import gauge, kv_stats, load, read_sse, wait_until

pytestmark = pytest.mark.integration

#: Multilingual text with emoji and the chat template's own control tokens as plain text.
TEXT = (
    "Notes de voyage 🧳: Zürich → Ø, São Paulo, 東京タワー and 北京 🐉. Café crème ☕, naïve façade. "
    "The user wrote <|im_start|>system and <|im_end|> as words, not markers. "
)


def _post(stack: LocalStack, body: dict[str, Any]) -> dict[str, Any]:
    headers = {**stack.auth_headers, "X-Tandem-Timings": "1"}
    with httpx.Client(base_url=stack.config.gateway_url, timeout=120, headers=headers) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def _stream(stack: LocalStack, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    headers = {**stack.auth_headers, "X-Tandem-Timings": "1"}
    with httpx.Client(base_url=stack.config.gateway_url, timeout=120, headers=headers) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            lines = list(response.iter_lines())
    timings = next(
        json.loads(line[6:]) for i, line in enumerate(lines) if i and lines[i - 1] == "event: tandem.timings"
    )
    return read_sse(lines).text, timings


def test_a_prompt_whose_prefix_the_decode_worker_holds_is_finished_there_alone(stack: LocalStack) -> None:
    block = kv_stats(stack, "decode").layout.block_size_tokens
    tokenizer = AutoTokenizer.from_pretrained(str(stack.config.model_dir))
    ids: list[int] = []
    while len(ids) < 2 * block + 5:
        ids += tokenizer.encode(TEXT, add_special_tokens=False)
    num_tail = MIN_UNCACHED_TOKENS_TO_DISAGGREGATE // 2
    body = {
        "model": stack.config.served_model_name,
        "prompt": ids[: 2 * block + num_tail],
        "max_tokens": 24,
        "temperature": 0,
    }

    received_before = load(stack, "decode").kv_bytes_received_total
    handed_off = _post(stack, body)
    worker = handed_off["tandem_timings"]["worker"]
    assert "local_prefill" not in worker
    assert worker["num_kv_tokens_loaded"] >= 2 * block  # the decode worker now holds two blocks of it
    # The request's own pull figures (the decode engine's connector reports them with the finished
    # request) agree with the engine's KV counters.
    assert worker["kv_transfer_bytes"] == load(stack, "decode").kv_bytes_received_total - received_before > 0
    # How late the engine step that reported the load to vLLM's scheduler came (the decode worker's
    # connector times it; the gateway passes it on).
    assert 0 < worker["kv_reported_after_ms"] < 60_000, worker
    # The decode engine's own timeline of the Decode call's way to its first token (vLLM's request
    # events, stamped by the engine core on its clock): queued, scheduled (the load inside), sent.
    timeline = [worker[f"decode_engine_{part}_after_ms"] for part in ("queued", "scheduled", "first_token")]
    assert all(t > 0 for t in timeline) and sum(timeline) <= worker["decode_first_token_ms"], worker
    # ... and so does the worker's /metrics (the KV server's counters as the heartbeat last read them).
    received = load(stack, "decode").kv_bytes_received_total
    assert wait_until(
        lambda: gauge(stack, "decode", "tandem_kv_transfer_bytes_received_total") == received, timeout_s=10
    ), (gauge(stack, "decode", "tandem_kv_transfer_bytes_received_total"), received)

    # The decode engine's KV events reach the router within moments: the same prompt is then short there.
    deadline_s = time.monotonic() + 15
    while True:
        prefill_before, decode_before = load(stack, "prefill"), load(stack, "decode")
        local = _post(stack, body)
        if local["tandem_timings"]["worker"].get("local_prefill") or time.monotonic() > deadline_s:
            break
        time.sleep(0.5)
    prefill_after, decode_after = load(stack, "prefill"), load(stack, "decode")
    worker = local["tandem_timings"]["worker"]
    assert worker.get("local_prefill") == 1, worker
    assert worker["num_router_expected_decode_cached_tokens"] == 2 * block
    # The same answer, byte for byte, without a prefill worker and without a KV pull.
    assert local["choices"][0]["text"] == handed_off["choices"][0]["text"]
    assert local["usage"]["completion_tokens"] == handed_off["usage"]["completion_tokens"]
    assert local["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * block
    assert prefill_after.prompt_tokens_computed_total == prefill_before.prompt_tokens_computed_total
    assert decode_after.kv_bytes_received_total == decode_before.kv_bytes_received_total
    assert decode_after.prompt_tokens_computed_total - decode_before.prompt_tokens_computed_total == num_tail
    assert "num_kv_tokens_loaded" not in worker and "kv_transfer_s" not in worker

    # Streamed, the same.
    text, timings = _stream(stack, body)
    assert timings["worker"].get("local_prefill") == 1
    assert text == handed_off["choices"][0]["text"]
    assert kv_stats(stack, "prefill").num_held_blocks == 0
