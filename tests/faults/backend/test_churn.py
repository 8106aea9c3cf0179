"""Promise 3: no leaks under churn. Many requests (1,000 by default) through
the real stack, a good part of them cancelled before an answer, cut off
mid-stream or timed out by the client. Afterwards both kinds of engine hold
no request and no KV block, the router reserves no budget, the quota holds no
concurrency slot, and what was billed is what was served."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from tandem.local.stack import LocalStack
from tests.faults.backend.client import chat_body, usage_total
from tests.faults.backend.conftest import KV_LEASE_S, BackendStack
from tests.faults.ledger import FaultLedger
from tests.probes import gauge, quiesce, quota_slots, router_budget_tokens, wait_until, worker_names

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(1800)]

NUM_REQUESTS = int(os.environ.get("TANDEM_FAULTS_CHURN_REQUESTS", "1000"))
CONCURRENCY = 12
SEED = 7

#: How each request behaves (weights); the first two run to completion, billed to one tenant, the
#: others are cut short on purpose, billed to another.
KINDS = {
    "complete stream": 35,
    "complete, not streamed": 15,
    "disconnect mid-stream": 20,
    "client timeout": 15,
    "cancelled before the answer": 15,
}
COMPLETE_KINDS = ("complete stream", "complete, not streamed")

_SHARED_PREFIX = "You are a helpful assistant for a shipping company. " * 30


@dataclass
class Outcome:
    kind: str
    what: str
    completion_tokens: int = 0


def _prompt(rng: random.Random) -> str:
    choice = rng.random()
    question = f"Question {rng.randrange(10_000)}: where is parcel {rng.randrange(1000)}?"
    if choice < 0.4:
        return _SHARED_PREFIX + question  # shares cached KV blocks with other requests
    return question


async def _one(client: httpx.AsyncClient, stack: LocalStack, rng: random.Random, kind: str, key: str) -> Outcome:
    # Long enough to be cut mid-stream when that is the point; short otherwise (1,000 requests on two
    # cores: the answers' length is most of the suite's time, and billing is exact at any length).
    max_tokens = rng.randint(8, 24) if kind == "disconnect mid-stream" else rng.randint(1, 8)
    body = chat_body(stack, _prompt(rng), max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
    headers = {"Authorization": f"Bearer {key}"}
    if kind == "complete, not streamed":
        body["stream"] = False
        body.pop("stream_options")
        resp = await client.post("/v1/chat/completions", json=body, headers=headers, timeout=300)
        if resp.status_code != 200:
            return _refused(kind, resp)
        return Outcome(kind, "200", resp.json()["usage"]["completion_tokens"])
    if kind == "complete stream":
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers, timeout=300) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return _refused(kind, resp)
            tokens, done, error = 0, False, ""
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {") and "error" in (event := json.loads(line[6:])):
                    error = json.dumps(event["error"])
                elif line.startswith("data: {") and event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            if error or not done:
                return Outcome(kind, f"BROKEN: stream ended {'with ' + error if error else 'without [DONE]'}")
            return Outcome(kind, "200", tokens)
    if kind == "disconnect mid-stream":
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers, timeout=300) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return _refused(kind, resp)
            wanted = rng.randint(1, 6)
            seen = 0
            lines = resp.aiter_lines()
            async for line in lines:
                seen += line.startswith("data:")
                if seen >= wanted:
                    break
            return Outcome(kind, "client left mid-stream")
    if kind == "client timeout":
        try:
            await client.post(
                "/v1/chat/completions", json=body, headers=headers, timeout=httpx.Timeout(rng.uniform(0.05, 1.0))
            )
            return Outcome(kind, "answered before the client's timeout")
        except httpx.TimeoutException:
            return Outcome(kind, "client timed out")
    task = asyncio.ensure_future(client.post("/v1/chat/completions", json=body, headers=headers, timeout=300))
    await asyncio.sleep(rng.uniform(0, 0.3))
    task.cancel()
    try:
        await task
        return Outcome(kind, "answered before the cancel")
    except asyncio.CancelledError:
        return Outcome(kind, "cancelled by the client")


def _refused(kind: str, resp: httpx.Response) -> Outcome:
    # Under load the router's admission queue may answer 503 with Retry-After; nothing else is allowed.
    assert resp.status_code == 503 and resp.headers.get("retry-after"), (resp.status_code, resp.text[:300])
    return Outcome(kind, f"503 {resp.json()['error'].get('code')} with Retry-After")


async def _churn(stack: LocalStack, keys: dict[str, str]) -> list[Outcome]:
    rng = random.Random(SEED)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=NUM_REQUESTS)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=stack.config.gateway_url, limits=limits) as client:

        async def worker(i: int) -> None:
            wrng = random.Random(SEED * 1000 + i)
            while not queue.empty():
                kind = queue.get_nowait()
                key = keys["clean"] if kind in COMPLETE_KINDS else keys["chaos"]
                outcomes.append(await _one(client, stack, wrng, kind, key))

        await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))
    return outcomes


def test_churn_leaves_nothing_behind(backend: BackendStack, ledger: FaultLedger) -> None:
    stack = backend.stack
    workers = worker_names(stack)
    keys = {"clean": stack.create_tenant_key("churn-clean"), "chaos": stack.create_tenant_key("churn-chaos")}
    headers = {name: {"Authorization": f"Bearer {key}"} for name, key in keys.items()}
    usage_before = {name: usage_total(stack, h) for name, h in headers.items()}
    generated_before = sum(gauge(stack, n, "vllm:generation_tokens_total") for n in workers)

    with ledger.fault(f"churn: {NUM_REQUESTS} requests, cancelled / cut off / timed out at random") as f:
        started = time.monotonic()
        outcomes = asyncio.run(_churn(stack, keys))
        elapsed_s = time.monotonic() - started
        f.tried(len(outcomes))
        assert len(outcomes) == NUM_REQUESTS
        for (kind, what), num in sorted(Counter((o.kind, o.what) for o in outcomes).items()):
            f.saw(f"{kind}: {what}", num)
        broken = [f"{o.kind}: {o.what}" for o in outcomes if o.what.startswith("BROKEN")]
        assert not broken, f"{len(broken)} complete stream(s) did not end with usage and [DONE]: {broken[:5]}"
        print(f"churn: {NUM_REQUESTS} requests in {elapsed_s:.0f} s")

        left = quiesce(stack, timeout_s=KV_LEASE_S + 15)
        f.leaked("running requests", sum(r.running + r.waiting for r in left.values()))
        f.leaked("KV blocks in use (%)", round(sum(r.kv_usage_perc for r in left.values()) * 100, 3))
        f.leaked("KV blocks held for decode", sum(r.held_blocks for r in left.values()))
        f.leaked("KV prefetch bytes staged", sum(r.staged_bytes for r in left.values()))
        wait_until(lambda: router_budget_tokens(stack) == 0, timeout_s=30)
        f.leaked("router budget tokens", router_budget_tokens(stack))
        wait_until(lambda: quota_slots(stack, "churn-chaos") + quota_slots(stack, "churn-clean") == 0, timeout_s=30)
        f.leaked("quota concurrency slots", quota_slots(stack, "churn-chaos") + quota_slots(stack, "churn-clean"))

        # Billing. Requests that ran to completion: billed exactly what their clients were told.
        served_clean = [o for o in outcomes if o.kind in COMPLETE_KINDS and o.what == "200"]
        wait_until(
            lambda: (
                usage_total(stack, headers["clean"])["requests"] - usage_before["clean"]["requests"]
                >= len(served_clean)
            ),
            timeout_s=30,
        )
        clean = {k: v - usage_before["clean"][k] for k, v in usage_total(stack, headers["clean"]).items()}
        chaos = {k: v - usage_before["chaos"][k] for k, v in usage_total(stack, headers["chaos"]).items()}
        f.leaked("requests served but not billed", len(served_clean) - clean["requests"])
        f.leaked(
            "completion tokens billed ≠ served",
            abs(clean["completion_tokens"] - sum(o.completion_tokens for o in served_clean)),
        )
        # Requests cut short: billed for what the engines generated for them at most (the gateway counts
        # what it received; a token or two may be generated after the abort and never sent).
        generated = sum(gauge(stack, n, "vllm:generation_tokens_total") for n in workers) - generated_before
        billed = clean["completion_tokens"] + chaos["completion_tokens"]
        f.leaked("completion tokens billed beyond generated", max(0, billed - generated))
        print(f"billed completion tokens {billed}, engines generated {generated}; chaos tenant {chaos}")
