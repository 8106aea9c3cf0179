"""The KV pull through shared memory between real engines: a real decode engine loads a real prefill
engine's KV through /dev/shm (both workers of this host), and answers exactly as when the same
prompt's KV crosses over gRPC (the shared-memory path refused by a failpoint on the prefill worker,
so the decode worker falls back, counted with its reason); and a prefetched request (``PrefetchKV``
before the prefill, as the gateway orders it) streams its KV through shared memory while the prefill
runs and answers as one whose KV crossed over gRPC.

The two workers alone (no router, no gateway: nothing here is about placement), driven over their own
gRPC API as the gateway drives them (its mTLS role): a prefill that keeps its KV, then the decode
from its handle, which pulls after the prefill (no prefetch)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tandem.common import kv_capability
from tandem.common.registry import WorkerRegistry
from tandem.common.tls import aio_channel
from tandem.local.stack import LocalStack, StackConfig
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.worker.kv_connector import shm
from tests.integration.lora_workers import Workers, decode_request, p_to_d, sampling
from tests.probes import gauge, kv_stats, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

#: Multilingual text with emoji, right-to-left and control-like strings, and the chat template's own
#: markers as plain words; repeated to a prompt of a few KV blocks.
TEXT = (
    "Carnet 🧳: Zürich → Ø, São Paulo, 東京タワー, 北京 🐉, القاهرة, \u202eevil\u202c. "
    "The user wrote <|im_start|>system and <|im_end|> and '); DROP TABLE kv;-- as words. "
)


@pytest.fixture(scope="module")
def shm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Path]]:
    failpoints = Path(tmp_path_factory.mktemp("shm-failpoints"))
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-it-shm-{uuid.uuid4().hex[:8]}",
        log_dir=Path(tmp_path_factory.mktemp("shm-stack-logs")),
        start_router=False,
        start_gateway=False,
        extra_env={"TANDEM_FAILPOINTS_DIR": str(failpoints)},
    )
    stack = LocalStack(config, progress=lambda msg: print(f"[shm stack] {msg}", flush=True))
    try:
        stack.start()
    except BaseException:
        for name in ("prefill", "decode"):
            print(f"--- {name} log tail ---\n{stack.tail(name)}")
        stack.stop()
        raise
    try:
        yield stack, failpoints
    finally:
        stack.stop()


async def _prefill_then_decode(stack: LocalStack, prompt: list[int]) -> tuple[list[int], str]:
    """(token ids, text) of ``prompt``: prefilled keeping its KV, decoded from its handle (a pull)."""
    c = stack.config
    tls = stack.tls("gateway")
    ports = c.worker_ports()
    async with (
        aio_channel(f"{c.host}:{ports['prefill'].port}", tls) as prefill_channel,
        aio_channel(f"{c.host}:{ports['decode'].port}", tls) as decode_channel,
    ):
        w = Workers(worker_pb2_grpc.WorkerStub(prefill_channel), worker_pb2_grpc.WorkerStub(decode_channel))
        answer = await p_to_d(w, prompt, "")
    assert answer.num_kv_tokens_loaded > 0, answer
    return answer.token_ids, answer.text


def _paths(stack: LocalStack) -> tuple[int, int, int]:
    """(loads through shared memory, fallbacks refused by the peer, bytes received) of the decode worker."""
    stats = kv_stats(stack, "decode")
    return stats.shm_loads_total, stats.shm_fallbacks_total.get("peer_refused", 0), stats.bytes_received_total


def test_workers_advertise_shared_memory_of_this_host(shm_stack: tuple[LocalStack, Path]) -> None:
    stack, _ = shm_stack

    async def records() -> list[Any]:
        registry = WorkerRegistry(stack.config.redis_url, key_prefix=stack.config.key_prefix)
        return await registry.list_workers()

    found = {r.role: r for r in asyncio.run(records())}
    assert set(found) == {"prefill", "decode"}
    for record in found.values():
        assert record.kv_data_paths == ("grpc", "shm")
        assert record.kv_shm_host_id == shm.host_id() and record.kv_shm_dir_token == shm.dir_token("/dev/shm")


def test_a_real_decode_engine_answers_the_same_from_shared_memory_as_over_grpc(
    shm_stack: tuple[LocalStack, Path],
) -> None:
    stack, failpoints = shm_stack
    block = kv_stats(stack, "decode").layout.block_size_tokens
    tokenizer = AutoTokenizer.from_pretrained(str(stack.config.model_dir))
    # Two prompts of several blocks each; each crosses once by each path, in both orders, so that each path
    # carries one whole prompt (the second decode of a prompt pulls only what the decode does not cache).
    prompts = [tokenizer.encode(f"{i}: {TEXT * 5}") for i in ("一", "二")]
    armed = failpoints / "kv_shm.serve"
    for prompt, order in zip(prompts, (("shm", "grpc"), ("grpc", "shm")), strict=True):
        assert len(prompt) > 2 * block
        answers = {}
        for path in order:
            if path == "grpc":
                armed.write_text("error the test refuses shared memory")
            before = _paths(stack)
            try:
                answers[path] = asyncio.run(_prefill_then_decode(stack, prompt))
            finally:
                armed.unlink(missing_ok=True)
            after = _paths(stack)
            assert after[2] > before[2], f"the {path} decode pulled nothing"
            if path == "shm":
                assert (after[0] - before[0], after[1] - before[1]) == (1, 0), (before, after)
            else:
                assert (after[0] - before[0], after[1] - before[1]) == (0, 1), (before, after)
        assert answers["shm"] == answers["grpc"] and answers["shm"][1] != "", answers
    # Each fallback is on the decode worker's /metrics (as the service last read the engine's counters).
    loads, refused, _ = _paths(stack)
    assert refused >= 2 and loads >= 2
    assert wait_until(
        lambda: (
            (
                gauge(stack, "decode", "tandem_kv_shm_loads_total"),
                gauge(stack, "decode", "tandem_kv_shm_fallbacks_total"),
            )
            == (loads, refused)
        ),
        timeout_s=45,
    )


async def _salted(stack: LocalStack, prompt: list[int], salt: str, *, prefetch: bool) -> tuple[list[int], str, bool]:
    """(token ids, text, whether the load came from a prefetch) of ``prompt`` under cache salt ``salt`` (a
    salt of its own: neither worker's prefix cache serves it), prefetched as the gateway orders it (PrefetchKV
    before the Prefill) or pulled after the prefill."""
    c = stack.config
    tls = stack.tls("gateway")
    ports = c.worker_ports()
    request_id, capability = uuid.uuid4().hex, kv_capability.mint()
    async with (
        aio_channel(f"{c.host}:{ports['prefill'].port}", tls) as prefill_channel,
        aio_channel(f"{c.host}:{ports['decode'].port}", tls) as decode_channel,
    ):
        prefill, decode = worker_pb2_grpc.WorkerStub(prefill_channel), worker_pb2_grpc.WorkerStub(decode_channel)
        if prefetch:
            ordered = await decode.PrefetchKV(
                worker_pb2.PrefetchKVRequest(
                    request_id=request_id,
                    kv_address=f"{c.host}:{ports['prefill'].kv_port}",
                    num_prompt_tokens=len(prompt),
                    kv_capability=capability,
                )
            )
            assert ordered.accepted, ordered
        pre = await prefill.Prefill(
            worker_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling(),
                keep_kv=True,
                kv_capability=capability,
                cache_salt=salt,
            )
        )
        assert pre.HasField("kv_handle") and pre.num_cached_tokens == 0, pre
        request = decode_request(prompt, pre, "", request_id, capability)
        request.cache_salt = salt
        tokens, text, prefetched = [pre.first_token_id], pre.first_text, False
        async for chunk in decode.Decode(request):
            tokens += list(chunk.token_ids)
            text += chunk.text
            if chunk.finish_reason:
                assert chunk.stats.num_kv_tokens_loaded > 0, chunk.stats
                prefetched = chunk.stats.kv_prefetched
    return tokens, text, prefetched


def test_a_prefetched_request_streams_its_kv_through_shared_memory_and_answers_as_over_grpc(
    shm_stack: tuple[LocalStack, Path],
) -> None:
    stack, failpoints = shm_stack
    tokenizer = AutoTokenizer.from_pretrained(str(stack.config.model_dir))
    prompt = tokenizer.encode(f"三: {TEXT * 5}")
    before = kv_stats(stack, "decode")
    prefetched = asyncio.run(_salted(stack, prompt, "salt-shm-🧪", prefetch=True))
    middle = kv_stats(stack, "decode")
    assert prefetched[2], "the load did not come from the prefetch"
    assert middle.shm_prefetches_total - before.shm_prefetches_total == 1
    assert dict(middle.shm_fallbacks_total) == dict(before.shm_fallbacks_total)
    # The same prompt under another salt, its KV over gRPC (shared memory refused): the same answer.
    armed = failpoints / "kv_shm.serve"
    armed.write_text("error the test refuses shared memory")
    try:
        pulled = asyncio.run(_salted(stack, prompt, "salt-grpc-\u202e", prefetch=False))
    finally:
        armed.unlink(missing_ok=True)
    assert not pulled[2] and pulled[:2] == prefetched[:2] and prefetched[1] != ""
    # The decode worker's /metrics count it (as the service last read the engine's counters).
    assert wait_until(lambda: gauge(stack, "decode", "tandem_kv_shm_prefetches_total") >= 1, timeout_s=45)
