"""Streams whose decode worker is SIGKILLed mid-answer (``make bench-migration``).

A supervised local stack (as ``make run`` runs it: a worker that exits is started again): one
prefill and two decode workers (real vLLM engines), the Ray Serve router, the gateway. Each stream
is sent twice through the gateway: once undisturbed (the reference), then again while the decode
worker serving it is SIGKILLed at a random token. The gateway migrates it (tandem.gateway.orchestrator):
the other decode worker computes the prompt and the tokens the client has (as prompt, or replayed),
and goes on. The client's text is compared with the reference's, token for token.

The streams (max_tokens 200, temperature 0) come in four kinds, a quarter each: a prompt that starts
with multi-byte characters (emoji, CJK, accents), stop strings, presence/frequency penalties with a
seed (taken as prompt with their counts carried: tandem.worker.carried_penalties), and plain.
``--concurrency C`` sends C streams at once and kills one decode worker that is
serving some of them, at a random token of the first; the others on it migrate too.

Per stream, from the gateway's own timings (``X-Tandem-Timings``: ``migration_ms`` is the time from
the failure seen to the first token from the new worker, ``num_resumed_tokens`` the tokens it
replayed): the extra gap, and the tokens recomputed (prompt + resumed). Ends with one line:

    migration: streams=… completed=… identical=… extra_gap_p99_ms=… reprefill_tokens_p50=… leaked_blocks=…

and, after it, what the kills may have left anywhere: KV in use, requests running, the router's
reserved budget tokens, and the dev tenant's quota slots (``kills=`` counts the SIGKILLs).

Each kill costs a worker restart (an engine start: ~30-60 s on a 2-core host), so 200 streams take
hours there; ``--streams`` sets the number.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from tandem.local.stack import LocalStack, StackConfig, free_port
from tests.probes import gauge, quiesce, quota_slots, router_budget_tokens, wait_until, worker_names

MAX_TOKENS = 200
KINDS = ("multibyte", "stop", "penalties", "plain")
TOPICS = ("a lighthouse keeper", "a map of the sea", "a clockmaker's apprentice", "a winter market", "a lost kite")


def body_for(index: int, model: str) -> dict[str, Any]:
    kind = KINDS[index % len(KINDS)]
    topic = TOPICS[index % len(TOPICS)]
    content = f"Write a story about {topic}, number {index}."
    extra: dict[str, Any] = {}
    if kind == "multibyte":
        content = f"東京 👋 Olá, café! {content}"
    elif kind == "stop":
        extra["stop"] = ["\n\n\n", "THE END"]
    elif kind == "penalties":
        extra.update(presence_penalty=0.4, frequency_penalty=0.3, seed=index)
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


@dataclass
class Stream:
    """One streamed answer as the client saw it."""

    status: int = 0
    tokens_text: list[str] = field(default_factory=list)  # one entry per content delta
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.tokens_text)


def stream(url: str, headers: dict[str, str], body: dict[str, Any], on_delta: Any = None) -> Stream:
    result = Stream()
    event = ""
    with (
        httpx.Client(base_url=url, timeout=300) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers={**headers, "X-Tandem-Timings": "1"}) as r,
    ):
        result.status = r.status_code
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
                continue
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                result.done = True
                continue
            payload = json.loads(data)
            if event == "tandem.timings":
                result.timings = payload
                continue
            if "error" in payload:
                result.errors.append(payload["error"])
            for choice in payload.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    result.tokens_text.append(content)
                    if on_delta is not None:
                        on_delta(len(result.tokens_text))
            if payload.get("usage"):
                result.usage = payload["usage"]
    return result


def first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ (len of the shorter when one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def running_decodes(stack: LocalStack) -> list[str]:
    """Decode workers with a request running now (one whose metrics do not answer is not serving)."""
    running = []
    for name in worker_names(stack, "decode"):
        try:
            if stack.is_running(name) and gauge(stack, name, "vllm:num_requests_running"):
                running.append(name)
        except httpx.HTTPError:
            continue
    return running


class Round:
    """Streams sent at once; one decode worker that serves some of them is SIGKILLed when the first
    stream has received ``kill_at`` content deltas. Records how far each stream was at that moment."""

    def __init__(self, stack: LocalStack, url: str, headers: dict[str, str], kill_at: int, rng: random.Random) -> None:
        self._stack, self._url, self._headers = stack, url, headers
        self._kill_at, self._rng = kill_at, rng
        self._lock = threading.Lock()
        self.killed = ""
        self.positions: dict[int, int] = {}
        self.positions_at_kill: dict[int, int] = {}

    def _on_delta(self, slot: int, num: int) -> None:
        with self._lock:
            self.positions[slot] = num
            if slot != 0 or num < self._kill_at or self.killed:
                return
            victims = running_decodes(self._stack)
            if victims:
                self.killed = self._rng.choice(victims)
                self._stack.kill(self.killed)
                self.positions_at_kill = dict(self.positions)

    def run(self, bodies: list[dict[str, Any]]) -> list[Stream]:
        results: dict[int, Stream] = {}

        def one(slot: int, body: dict[str, Any]) -> None:
            results[slot] = stream(self._url, self._headers, body, lambda n: self._on_delta(slot, n))

        threads = [threading.Thread(target=one, args=(slot, body)) for slot, body in enumerate(bodies)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [results[slot] for slot in range(len(bodies))]


def everyone_back(stack: LocalStack, timeout_s: float = 600) -> None:
    names = set(worker_names(stack))
    client = redis.Redis.from_url(stack.config.redis_url, socket_timeout=2)
    by_port = {p.port: n for n, p in stack.config.worker_ports().items()}

    def registered() -> set[str]:
        found = set()
        for key in client.scan_iter(match=f"{stack.config.key_prefix}:worker:*"):
            raw = client.get(key)
            if raw:
                found.add(by_port.get(int(json.loads(raw)["address"].rpartition(":")[2]), ""))
        return found

    def ready(name: str) -> bool:
        try:
            return stack.is_running(name) and stack._worker_ready(name)
        except Exception:  # grpc.RpcError while it starts
            return False

    # A SIGKILLed worker's registration outlives it by the registry's TTL: ask each one itself too.
    if not wait_until(lambda: all(ready(n) for n in names) and registered() >= names, timeout_s=timeout_s):
        raise RuntimeError(f"workers not back: {registered()} of {names}")
    time.sleep(2.5)  # channels redial a restarted address within their reconnect backoff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    config = StackConfig.with_free_ports(
        num_prefill_workers=1,
        num_decode_workers=2,
        supervise=True,
        restart_backoff_s=0.5,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        key_prefix=f"tandem-bench-migration-{uuid.uuid4().hex[:6]}",
        log_dir=Path(".run/bench-migration"),
        min_uncached_tokens_to_disaggregate=0,
    )
    stack = LocalStack(config, progress=lambda m: print(f"[bench-migration] {m}", flush=True))
    stack.start()
    url, headers, model = config.gateway_url, stack.auth_headers, config.served_model_name
    rows: list[dict[str, Any]] = []
    kills = 0
    try:
        index = 0
        while index < args.streams:
            bodies = [body_for(i, model) for i in range(index, min(args.streams, index + args.concurrency))]
            references = [stream(url, headers, b) for b in bodies]
            kill_at = rng.randrange(1, max(2, min(len(references[0].tokens_text), MAX_TOKENS) - 1))
            round_ = Round(stack, url, headers, kill_at, rng)
            results = round_.run(bodies)
            for slot, (ref, got) in enumerate(zip(references, results, strict=True)):
                worker = (got.timings or {}).get("worker", {})
                migrated = bool(worker.get("num_migrations"))
                prompt_tokens = (got.usage or {}).get("prompt_tokens", 0)
                rows.append(
                    {
                        "index": index + slot,
                        "kind": KINDS[(index + slot) % len(KINDS)],
                        "killed": bool(round_.killed),
                        "migrated": migrated,
                        "completed": got.status == 200 and got.done and not got.errors,
                        "identical": got.text == ref.text,
                        "first_difference_char": first_difference(ref.text, got.text),
                        "kill_char": len("".join(got.tokens_text[: round_.positions_at_kill.get(slot, 0)])),
                        "gap_ms": worker.get("migration_ms"),
                        "reprefill_tokens": prompt_tokens + worker.get("num_resumed_tokens", 0) if migrated else None,
                    }
                )
                print(json.dumps(rows[-1], ensure_ascii=False), flush=True)
            index += len(bodies)
            if round_.killed:
                kills += 1
                everyone_back(stack)
        left = quiesce(stack, timeout_s=60)
        leaked_blocks = sum(r.held_blocks for r in left.values())
        kv_in_use_pct = sum(r.kv_usage_perc for r in left.values()) * 100
        leaked_requests = sum(r.running + r.waiting for r in left.values())
        wait_until(lambda: router_budget_tokens(stack) == 0, timeout_s=30)
        leaked_budget_tokens = router_budget_tokens(stack)
        leaked_quota_slots = quota_slots(stack, config.dev_tenant_id)
    finally:
        stack.stop()
    completed = sum(r["completed"] for r in rows)
    identical = sum(r["identical"] for r in rows)
    gaps = sorted(r["gap_ms"] for r in rows if r["gap_ms"] is not None)
    reprefill = [r["reprefill_tokens"] for r in rows if r["reprefill_tokens"] is not None]
    for r in rows:
        if not r["identical"]:
            where = "after" if r["first_difference_char"] >= r["kill_char"] else "BEFORE"
            print(
                f"[bench-migration] stream {r['index']} ({r['kind']}) differs at char {r['first_difference_char']}, "
                f"{where} the kill (char {r['kill_char']})"
            )
    gap_p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else float("nan")
    print(
        f"migration: streams={len(rows)} completed={completed} identical={identical} "
        f"migrated={sum(r['migrated'] for r in rows)} extra_gap_p99_ms={gap_p99:.0f} "
        f"reprefill_tokens_p50={statistics.median(reprefill) if reprefill else 0:.0f} leaked_blocks={leaked_blocks} "
        f"kv_in_use_pct={kv_in_use_pct:.2f} leaked_requests={leaked_requests:.0f} kills={kills} "
        f"leaked_budget_tokens={leaked_budget_tokens} leaked_quota_slots={leaked_quota_slots}"
    )


if __name__ == "__main__":
    main()
