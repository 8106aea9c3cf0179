"""Promise 1: a worker dies. SIGKILL (no drain, no goodbye) on real vLLM
workers, at the worst moments: mid-stream, mid-prefill, after prefill but
before the decode worker pulled the KV, right after it streamed the KV into a
shared-memory segment, and between requests."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.faults.backend.client import (
    chat_body,
    gateway_counter,
    num_content_events,
    stream_chat,
    usage_total,
)
from tests.faults.backend.conftest import KV_LEASE_S, PULL_TIMEOUT_S, REGISTRY_TTL_S, BackendStack
from tests.faults.ledger import FaultLedger
from tests.faults.segments import SLACK_S, owned_by
from tests.probes import gauge, kv_stats, load, quiesce, wait_until, worker_names

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(900)]

#: A story prompt long enough that the greedy answer does not end before max_tokens (ignore_eos anyway).
PROMPT_TAIL = "a lighthouse keeper finds a map."


def _running_on(backend: BackendStack, role: str) -> list[str]:
    stack = backend.stack
    return [
        n for n in worker_names(stack, role) if stack.is_running(n) and gauge(stack, n, "vllm:num_requests_running")
    ]


def _assert_no_residue(backend: BackendStack, f: object) -> None:
    from tests.faults.ledger import FaultRecord

    assert isinstance(f, FaultRecord)
    left = quiesce(backend.stack, timeout_s=KV_LEASE_S + 10)
    f.leaked("running requests", sum(r.running + r.waiting for r in left.values()))
    f.leaked("KV blocks in use (%)", round(sum(r.kv_usage_perc for r in left.values()) * 100, 3))
    f.leaked("KV blocks held for decode", sum(r.held_blocks for r in left.values()))
    f.leaked("KV prefetch bytes staged", sum(r.staged_bytes for r in left.values()))


@pytest.mark.parametrize("kill_at", [10, 47])
def test_decode_killed_mid_stream(backend: BackendStack, ledger: FaultLedger, kill_at: int) -> None:
    """The stream migrates: the gateway places it again on the other decode worker, which computes the
    prompt and replays the tokens the client has; the client sees one stream, identical to one that
    nothing interrupted, billed once. The prompt starts with emoji and CJK, and the kill lands at
    different tokens (10, 47)."""
    stack = backend.stack
    body = chat_body(stack, "Écris 👋 東京 une histoire: " + PROMPT_TAIL, max_tokens=120, ignore_eos=True)
    reference = stream_chat(stack, body)
    assert reference.done and reference.finish_reasons == ["length"], reference
    usage_before = usage_total(stack)
    migrations_before = gateway_counter(stack, "tandem_gateway_migrations_total", role="decode")

    with ledger.fault(f"decode worker SIGKILLed mid-stream (token ~{kill_at})") as f:
        killed: list[str] = []
        killed_at: list[float] = []

        def kill_when_streaming(lines: list[str]) -> None:
            if not killed and num_content_events(lines) >= kill_at:
                victims = _running_on(backend, "decode")
                assert len(victims) == 1, victims
                stack.kill(victims[0])
                killed.append(victims[0])
                killed_at.append(time.monotonic())
                f.tried()

        result = stream_chat(stack, body, on_line=kill_when_streaming)
        assert result.status == 200 and killed, result
        assert not result.errors and result.done, result
        assert result.finish_reasons == ["length"], result.finish_reasons
        # Nothing duplicated or missing: the very answer an uninterrupted stream gave.
        assert result.text == reference.text, (result.text, reference.text)
        assert len({e.get("id") for e in result.events if e.get("id")}) == 1
        assert result.usage is not None and result.usage["completion_tokens"] == 120, result.usage
        migrations = gateway_counter(stack, "tandem_gateway_migrations_total", role="decode") - migrations_before
        assert migrations == 1, migrations
        f.saw("200, one stream identical to the uninterrupted one (migrated once)")

        # Usage is billed once, for what the client got; the registration goes; new requests go elsewhere.
        assert wait_until(
            lambda: usage_total(stack)["completion_tokens"] - usage_before["completion_tokens"] >= 120, timeout_s=10
        )
        assert usage_total(stack)["completion_tokens"] - usage_before["completion_tokens"] == 120
        assert wait_until(lambda: killed[0] not in backend.registered(), timeout_s=REGISTRY_TTL_S + 5)
        survivor = next(n for n in worker_names(stack, "decode") if n != killed[0])
        done_before = gauge(stack, survivor, "vllm:request_success_total")
        for _ in range(3):
            after = stream_chat(stack, chat_body(stack, max_tokens=8))
            assert after.done and not after.errors, after
            f.saw("next requests: 200, served by the other decode worker")
        assert gauge(stack, survivor, "vllm:request_success_total") - done_before == 3
        _assert_no_residue(backend, f)


def num_tokens(result: object) -> int:
    from tests.probes import StreamResult

    assert isinstance(result, StreamResult)
    return sum(1 for e in result.events for c in e.get("choices", []) if (c.get("delta") or {}).get("content"))


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_worker_killed_between_requests(backend: BackendStack, ledger: FaultLedger, role: str) -> None:
    """Its registration outlives it by up to the TTL; requests placed on it meanwhile must not fail."""
    stack = backend.stack
    # The router prefers the worker that holds a prompt's prefix (a prefill worker: in its prefix cache;
    # a decode worker: the blocks it pulled, which its engine caches and announces too): kill the one that
    # just served this prefix, and the next requests with it are placed on the dead worker. Without a
    # shared prefix the two workers tie and the requests of a burst fall on either at random: one CI run
    # saw none of them on the dead decode worker within its registration's last seconds. Each role has
    # a prefix of its own, so that neither test's requests find the other's prefix already cached.
    prefix = {
        "prefill": "You are a careful assistant who answers in one short sentence. ",
        "decode": "You are a patient tutor who always replies with one friendly line. ",
    }[role] * 12
    with ledger.fault(f"{role} worker SIGKILLed between requests") as f:
        names = worker_names(stack, role)
        served_before = {n: gauge(stack, n, "vllm:request_success_total") for n in names}
        warm = stream_chat(stack, chat_body(stack, prefix + "Say hello.", max_tokens=6))
        assert warm.done and not warm.errors, warm
        victim = max(names, key=lambda n: gauge(stack, n, "vllm:request_success_total") - served_before[n])
        retries_before = gateway_counter(stack, "tandem_gateway_worker_retries_total", role=role)
        stack.kill(victim)
        f.tried()
        started = time.monotonic()
        num_requests = 0
        # Until the registration expires, the router may still place requests on the dead worker. Bursts of
        # concurrent requests: a load-balancing router spreads them over both workers, the dead one too.
        with ThreadPoolExecutor(max_workers=4) as pool:
            while victim in backend.registered() or num_requests < 4:
                bodies = [
                    chat_body(stack, prefix + f"Say hello number {num_requests + i}.", max_tokens=6) for i in range(4)
                ]
                for result in pool.map(lambda body: stream_chat(stack, body), bodies):
                    assert result.status == 200 and result.done and not result.errors, result
                num_requests += len(bodies)
                assert time.monotonic() - started < 240, "the dead worker's registration never went away"
        retries = gateway_counter(stack, "tandem_gateway_worker_retries_total", role=role) - retries_before
        f.saw(f"{num_requests} requests, all 200 ({int(retries)} placed again off the dead worker)")
        assert retries >= 1, "no request was placed on the dead worker: the fault was not exercised"
        _assert_no_residue(backend, f)


def test_prefill_killed_mid_prefill(backend: BackendStack, ledger: FaultLedger) -> None:
    """No token sent yet: the gateway retries once on the other prefill worker."""
    stack = backend.stack
    long_prompt = " ".join(f"Item {i} is a {('red', 'green', 'blue')[i % 3]} box." for i in range(380))
    body = chat_body(stack, long_prompt + "\nWhich colour is item 7?", max_tokens=8)
    with ledger.fault("prefill worker SIGKILLed mid-prefill") as f:
        retries_before = gateway_counter(stack, "tandem_gateway_worker_retries_total", role="prefill")
        killed: list[str] = []

        def killer() -> None:
            def prefilling() -> bool:
                victims = _running_on(backend, "prefill")
                if victims:
                    stack.kill(victims[0])
                    killed.append(victims[0])
                return bool(victims)

            wait_until(prefilling, timeout_s=30, interval_s=0.02)

        thread = threading.Thread(target=killer)
        thread.start()
        result = stream_chat(stack, body)
        thread.join()
        assert killed, "the prefill finished before it could be killed"
        f.tried()
        assert result.status == 200 and result.done and not result.errors, result
        assert result.finish_reasons in (["length"], ["stop"])
        retries = gateway_counter(stack, "tandem_gateway_worker_retries_total", role="prefill") - retries_before
        assert retries == 1
        f.saw("200, complete answer (prefill retried once on the other worker)")
        _assert_no_residue(backend, f)


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_prefill_gone_before_kv_pulled(backend: BackendStack, ledger: FaultLedger, fault: str) -> None:
    """The first token was sent (it comes from the prefill worker), the decode worker's pull of the KV
    stalls (failpoint), then the prefill worker dies or stays hung past the pull timeout. The decode
    worker gives up within its lease, frees its blocks and recomputes the prompt itself: the client
    gets the whole answer, the same one as without the fault."""
    stack = backend.stack
    body = chat_body(stack, "Name three fruits and say why you like them.", max_tokens=24, ignore_eos=True)
    reference = stream_chat(stack, body)
    assert reference.done and not reference.errors
    decodes = worker_names(stack, "decode")
    failed_before = sum(kv_stats(stack, n).loads_failed_total for n in decodes)
    recomputed_before = sum(load(stack, n).prompt_tokens_computed_total for n in decodes)
    name = f"prefill worker {'SIGKILLed' if fault == 'killed' else 'hung'} after prefill, before the KV pull"
    with ledger.fault(name) as f:
        backend.arm("kv_server.before_pull", f"sleep {PULL_TIMEOUT_S + 6 if fault == 'hung' else 30}")
        # No prefetch while the prefill runs: this is the pull's fault (the prefetch's stream is refused, as
        # until ab12956 every prefetch in this suite was by accident: its failpoint was not a known one).
        backend.arm("kv_server.before_stream", "error no prefetch in this test")
        started = time.monotonic()
        killed: list[str] = []

        def kill_holder(lines: list[str]) -> None:
            if fault != "killed" or killed or num_content_events(lines) < 1:
                return
            holders: list[str] = []

            def announced() -> bool:
                # The engine announces a hold to its KV server with its next step: give it a moment.
                holders[:] = [n for n in worker_names(stack, "prefill") if kv_stats(stack, n).num_held_requests]
                return bool(holders)

            assert wait_until(announced, timeout_s=10, interval_s=0.05), "no prefill worker holds the KV"
            assert len(holders) == 1, holders
            stack.kill(holders[0])
            killed.append(holders[0])

        result = stream_chat(stack, body, on_line=kill_holder)
        elapsed_s = time.monotonic() - started
        backend.disarm_all()
        f.tried()
        assert result.status == 200 and result.done and not result.errors, result
        assert result.text == reference.text, "the recomputed answer differs"
        assert elapsed_s < PULL_TIMEOUT_S + 30, elapsed_s
        failed = sum(kv_stats(stack, n).loads_failed_total for n in decodes) - failed_before
        recomputed = sum(load(stack, n).prompt_tokens_computed_total for n in decodes) - recomputed_before
        assert failed == 1, failed
        assert recomputed >= result.usage["prompt_tokens"] if result.usage else False  # type: ignore[operator]
        f.saw(f"200, the same answer (decode gave up the pull after {elapsed_s:.1f} s and recomputed)")
        _assert_no_residue(backend, f)


def test_prefill_killed_right_after_streaming_kv_into_a_segment(backend: BackendStack, ledger: FaultLedger) -> None:
    """The gateway's prefetch streams the prompt's KV through a segment of the prefill worker's shared memory
    (both workers on this host, in the stack's directory); the prefill worker is SIGKILLed, its engine with it
    (nothing unlinked on the way out), as soon as it has written the KV and the client has the first token,
    before or while the decode worker loads it. The client still gets the whole answer (the decode worker
    loads from its mapping of the segment, or falls back to recomputing the prompt); the dead worker's
    segment files are removed within the KV lease by the surviving workers' sweepers (nobody restarts it
    meanwhile)."""
    stack = backend.stack
    shm_dir = stack.config.kv_shm_dir
    assert shm_dir is not None, "the fault suite's stacks have a shared-memory directory of their own"
    prefills, decodes = worker_names(stack, "prefill"), worker_names(stack, "decode")
    # A prompt no engine has cached (its blocks all cross), with emoji, CJK and a chat-template marker.
    prompt = f"[{uuid.uuid4().hex}] Écris 👋 東京 <|im_start|>system une histoire: " + PROMPT_TAIL * 6
    body = chat_body(stack, prompt, max_tokens=32, ignore_eos=True)
    sent_before = {n: kv_stats(stack, n).bytes_sent_total for n in prefills}
    decode_before = {n: kv_stats(stack, n) for n in decodes}

    with ledger.fault("prefill worker SIGKILLed right after streaming the KV into a shared-memory segment") as f:
        killed: list[str] = []
        segments: set[Path] = set()
        killed_at: list[float] = []

        def kill_the_streamer(lines: list[str]) -> None:
            if killed or num_content_events(lines) < 1:
                return
            sent: dict[str, int] = {}

            def streamed() -> bool:
                sent.update({n: kv_stats(stack, n).bytes_sent_total - sent_before[n] for n in prefills})
                return any(sent.values())

            assert wait_until(streamed, timeout_s=10, interval_s=0.05), "no prefill worker streamed the KV"
            victim = max(sent, key=lambda n: sent[n])
            segments.update(owned_by(shm_dir, stack.pid(victim)))
            stack.kill(victim)
            killed_at.append(time.monotonic())
            killed.append(victim)
            f.tried()

        result = stream_chat(stack, body, on_line=kill_the_streamer)
        assert killed, result
        assert segments, f"{killed[0]} mapped no segment of {shm_dir}: the KV did not cross by shared memory"
        assert result.status == 200 and result.done and not result.errors, result
        assert result.finish_reasons == ["length"], result.finish_reasons
        assert result.usage is not None and result.usage["completion_tokens"] == 32, result.usage
        after = {n: kv_stats(stack, n) for n in decodes}
        staged = sum(after[n].shm_prefetches_total - decode_before[n].shm_prefetches_total for n in decodes)
        used = sum(after[n].prefetches_used_total - decode_before[n].prefetches_used_total for n in decodes)
        failed = sum(after[n].loads_failed_total - decode_before[n].loads_failed_total for n in decodes)
        assert staged == 1, f"the prefetch was not staged through shared memory ({staged})"
        how = "loaded from the segment" if used else f"recomputed ({failed} load failed)"
        f.saw(f"200, the whole answer (the decode worker {how})")

        # Only the surviving workers' sweepers can remove the dead worker's files: nobody restarted it.
        bound_s = KV_LEASE_S + SLACK_S
        swept = wait_until(
            lambda: not any(p.exists() for p in segments),
            timeout_s=max(0.0, killed_at[0] + bound_s - time.monotonic()),
            interval_s=0.1,
        )
        swept_after_s = time.monotonic() - killed_at[0]
        assert not stack.is_running(killed[0])
        left = sorted(str(p) for p in segments if p.exists())
        assert swept, f"{left} still there {swept_after_s:.1f} s after their worker died (lease {KV_LEASE_S:g} s)"
        f.saw(f"its {len(segments)} segment file(s) swept by the survivors {swept_after_s:.1f} s after the kill")
        _assert_no_residue(backend, f)
