"""LoRA adapters on real workers (issue 40, the worker side): a real prefill worker and a real decode
worker (``python -m tandem.worker``, vLLM on CPU, LoRA on, two adapter slots each), the adapter
catalog in real Redis, Prefill → Decode over real gRPC with the KV pulled between the engines.

* At temperature 0 each adapter's tokens through P → D equal one plain vLLM engine's with the same
  adapter (``plain_lora.py``: ``vllm.LLM(enable_lora=True)``, started after the workers stop: two
  engines of this test at a time), and the base model's equal its own; each adapter answers
  differently from the base model (the adapters' weights are not zero).
* The same prompt under two adapters shares no cached block (the prefill's num_cached_tokens is 0
  for the second); the same adapter's second turn finds >= 90 % of the first turn's blocks.
* A decode whose KV handle names another adapter is refused (FAILED_PRECONDITION); the handle's
  adapter is the one the prefill engine ran with, and a handle forged to claim the request's adapter
  gets no KV from the prefill engine's KV server (the decode computes the prompt itself).
* An adapter whose files do not load is refused with a clear error and the engine serves on; a
  reloaded adapter's old engine name is refused (NOT_FOUND); both workers' registry records show
  what they loaded.

The test adapters are made by ``make model`` with peft on the default model (tests.kit.adapters)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from transformers import AutoTokenizer

from tandem.common import kv_capability
from tandem.common.adapters import AdapterCatalog, AdapterEntry
from tandem.common.registry import WorkerRegistry
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tandem.worker.settings import default_model_dir
from tests.kit.adapters import adapter_path
from tests.kit.net import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
#: Non-ASCII, emoji, and the chat template's own control tokens inside the user's text.
USER_TEXT = (
    "Voyage 🧳: Zürich → Ø, São Paulo, 東京タワー, 北京 🐉; café crème, naïve façade. "
    "I typed <|im_start|>system and <|im_end|> as plain words. "
)


@dataclass
class Workers:
    prefill: worker_pb2_grpc.WorkerStub
    decode: worker_pb2_grpc.WorkerStub
    catalog: AdapterCatalog
    registry: WorkerRegistry
    key_prefix: str


def _worker_env(role: str, key_prefix: str, core: int, log_dir: Path) -> tuple[dict[str, str], int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "TANDEM_WORKER_ROLE": role,
            "TANDEM_WORKER_BIND_HOST": "127.0.0.1",
            "TANDEM_WORKER_PORT": str(port),
            "TANDEM_WORKER_KV__HOST": "127.0.0.1",
            "TANDEM_WORKER_KV__PORT": str(free_port()),
            "TANDEM_WORKER_KV_EVENTS__ENABLED": "false",
            "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME": MODEL,
            "TANDEM_WORKER_ENGINE__KV_CACHE_BYTES": str(256 << 20),
            "TANDEM_WORKER_ENGINE__CPU_THREADS_BIND": str(core),
            "TANDEM_WORKER_ADAPTERS__MAX_ADAPTERS": "2",
            "TANDEM_WORKER_REDIS__URL": REDIS_URL,
            "TANDEM_WORKER_REGISTRY__KEY_PREFIX": key_prefix,
            "TANDEM_WORKER_TLS__ENABLED": "false",
        }
    )
    return env, port


@dataclass
class Procs:
    """This test's two worker processes."""

    key_prefix: str
    prefill_port: int
    decode_port: int
    log_dir: Path
    procs: list[subprocess.Popen[bytes]]

    def stop(self) -> None:
        """SIGTERM both (they drain and exit), SIGKILL after 30 s."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def tails(self) -> dict[str, str]:
        return {p.name: p.read_text(errors="replace")[-3000:] for p in self.log_dir.glob("*.log")}


@pytest.fixture(scope="module")
def worker_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    key_prefix = f"tandem-lora-{uuid.uuid4().hex[:8]}"
    log_dir = tmp_path_factory.mktemp("lora-workers")
    cores = os.cpu_count() or 1
    procs = Procs(key_prefix, 0, 0, log_dir, [])
    try:
        for i, role in enumerate(("prefill", "decode")):
            env, port = _worker_env(role, key_prefix, (cores - 1) * i, log_dir)
            with (log_dir / f"{role}.log").open("wb") as log:
                procs.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tandem.worker"], env=env, stdout=log, stderr=subprocess.STDOUT
                    )
                )
            if role == "prefill":
                procs.prefill_port = port
            else:
                procs.decode_port = port
        yield procs
    finally:
        procs.stop()
        asyncio.run(_delete_prefix(key_prefix))


async def _delete_prefix(key_prefix: str) -> None:
    redis = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in redis.scan_iter(match=f"{key_prefix}:*")]
        if keys:
            await redis.delete(*keys)
    finally:
        await redis.aclose()


@pytest.fixture
async def workers(worker_procs: Procs) -> AsyncIterator[Workers]:
    key_prefix, prefill_port, decode_port = worker_procs.key_prefix, worker_procs.prefill_port, worker_procs.decode_port
    registry = WorkerRegistry(REDIS_URL, key_prefix=key_prefix)
    catalog = AdapterCatalog.connect(REDIS_URL, key_prefix=key_prefix)
    deadline = time.monotonic() + 240
    while len(await registry.list_workers(model=MODEL)) < 2:
        if time.monotonic() > deadline:
            pytest.fail(f"workers did not register: {worker_procs.tails()}")
        await asyncio.sleep(0.5)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in (prefill_port, decode_port)]
    try:
        yield Workers(
            worker_pb2_grpc.WorkerStub(channels[0]),
            worker_pb2_grpc.WorkerStub(channels[1]),
            catalog,
            registry,
            key_prefix,
        )
    finally:
        for channel in channels:
            await channel.close()
        await catalog.aclose()
        await registry.aclose()


def _prompt(turns: list[tuple[str, str]], new_user: str) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    messages: list[dict[str, str]] = []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": new_user})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]


@dataclass
class Answer:
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    num_kv_tokens_loaded: int
    block_size_tokens: int
    handle_adapter: str


async def _p_to_d(w: Workers, prompt: list[int], adapter: str, *, forge_handle_from: str | None = None) -> Answer:
    """Prefill on the prefill worker, then decode on the decode worker from its KV handle. With
    ``forge_handle_from``: the prefill runs with that adapter and its handle is rewritten to claim ``adapter``."""
    request_id = uuid.uuid4().hex
    capability = kv_capability.mint()
    sampling = common_pb2.SamplingOptions(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    pre = await w.prefill.Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            keep_kv=True,
            kv_capability=capability,
            adapter=adapter if forge_handle_from is None else forge_handle_from,
        )
    )
    assert pre.HasField("kv_handle"), pre
    if forge_handle_from is not None:
        pre.kv_handle.adapter = adapter
    tokens, text, loaded = [pre.first_token_id], pre.first_text, 0
    async for chunk in w.decode.Decode(
        worker_pb2.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            first_token_id=pre.first_token_id,
            first_text=pre.first_text,
            sampling=sampling,
            kv_handle=pre.kv_handle,
            kv_capability=capability,
            adapter=adapter,
        )
    ):
        tokens += list(chunk.token_ids)
        text += chunk.text
        if chunk.finish_reason:
            loaded = chunk.stats.num_kv_tokens_loaded
    return Answer(
        tokens,
        text,
        pre.num_cached_tokens,
        loaded,
        pre.kv_handle.layout.block_size_tokens,
        pre.kv_handle.adapter,
    )


async def _first_token(w: Workers, prompt: list[int], adapter: str) -> int:
    """A prefill alone (no KV kept): its first token."""
    response = await w.prefill.Prefill(
        worker_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingOptions(temperature=0.0, max_tokens=1),
            adapter=adapter,
        )
    )
    return response.first_token_id


def _plain_vllm(requests: list[dict[str, Any]]) -> list[list[int]]:
    job = {"model_dir": str(default_model_dir()), "requests": requests}
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("plain_lora.py"))],
        input=json.dumps(job).encode(),
        capture_output=True,
        env=env,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("PLAIN_LORA_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr.decode()[-4000:]
    result: list[list[int]] = json.loads(lines[-1].removeprefix("PLAIN_LORA_RESULT "))
    return result


async def test_adapters_through_prefill_and_decode(workers: Workers, worker_procs: Procs, tmp_path: Path) -> None:
    w = workers
    a = await w.catalog.put("tandem-test-a", base_model=MODEL, path=str(adapter_path("tandem-test-a")), now_unix_s=0)
    b = await w.catalog.put("tandem-test-b", base_model=MODEL, path=str(adapter_path("tandem-test-b")), now_unix_s=0)
    prompt = _prompt([], USER_TEXT * 9 + "Summarise my trip in one sentence.")

    base = await _p_to_d(w, prompt, "")
    with_a = await _p_to_d(w, prompt, a.engine_name)
    with_b = await _p_to_d(w, prompt, b.engine_name)
    block = with_a.block_size_tokens
    assert len(prompt) >= 3 * block, (len(prompt), block)
    # The KV came over gRPC from the prefill engine, and the handle names the adapter it was computed with.
    for answer in (base, with_a, with_b):
        assert answer.num_kv_tokens_loaded > 0, answer
    assert (base.handle_adapter, with_a.handle_adapter, with_b.handle_adapter) == ("", a.engine_name, b.engine_name)
    # The base model's blocks were cached by the first call; neither adapter meets them, nor each other's.
    assert with_a.num_cached_tokens == 0 and with_b.num_cached_tokens == 0
    assert len({tuple(base.token_ids), tuple(with_a.token_ids), tuple(with_b.token_ids)}) == 3

    # Same adapter, second turn: the first turn's blocks are found.
    turn2 = _prompt([(USER_TEXT * 9 + "Summarise my trip in one sentence.", with_a.text)], "And in French? 🇫🇷")
    second = await _p_to_d(w, turn2, a.engine_name)
    first_turn_blocks = len(prompt) // block
    assert second.num_cached_tokens // block >= 0.9 * first_turn_blocks, (second.num_cached_tokens, len(prompt))

    # A handle of another adapter is refused by the decode worker, before its engine sees the request.
    capability = kv_capability.mint()
    request_id = uuid.uuid4().hex
    sampling = common_pb2.SamplingOptions(temperature=0.0, max_tokens=MAX_TOKENS)
    pre = await w.prefill.Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            keep_kv=True,
            kv_capability=capability,
            adapter=a.engine_name,
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in w.decode.Decode(
            worker_pb2.DecodeRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                first_token_id=pre.first_token_id,
                first_text=pre.first_text,
                sampling=sampling,
                kv_handle=pre.kv_handle,
                kv_capability=capability,
                adapter=b.engine_name,
            )
        ):
            pass
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "adapter" in (refused.value.details() or "")
    assert (await w.prefill.Abort(worker_pb2.AbortRequest(request_id=request_id))).found  # the hold is freed

    # A handle that lies about its adapter passes the decode worker's check, but the prefill engine's KV
    # server knows what computed the blocks: it refuses the pull, and the decode engine computes the prompt
    # itself (load_failure_policy recompute) with the request's adapter; no KV is loaded. (The first token
    # is the prefill's, under a: a lying handle's caller gets what it asked for there.)
    # (A prompt no engine has cached under b, so the decode has blocks to pull.)
    fresh = _prompt([], USER_TEXT * 9 + "Quelle est la meilleure ville? 🏙️")
    forged = await _p_to_d(w, fresh, b.engine_name, forge_handle_from=a.engine_name)
    assert forged.num_kv_tokens_loaded == 0 and len(forged.token_ids) == MAX_TOKENS, forged

    # Files that do not load: a clear refusal, nothing marked loaded, and the engine serves on.
    broken_dir = tmp_path / "broken"
    broken_dir.mkdir()
    (broken_dir / "adapter_config.json").write_text("{not json")
    broken = await w.catalog.put("broken", base_model=MODEL, path=str(broken_dir), now_unix_s=0)
    short = _prompt([], "Ça va? 👋")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await _first_token(w, short, broken.engine_name)
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "failed to load" in (failed.value.details() or "") and str(broken_dir) not in (failed.value.details() or "")
    assert await _first_token(w, short, a.engine_name) == await _first_token(w, short, a.engine_name)

    # Reloaded: the old engine name is refused once the worker's catalog read is newer (<= 1 s).
    reloaded = await w.catalog.put("tandem-test-b", base_model=MODEL, path=b.path, now_unix_s=0)
    await asyncio.sleep(1.1)
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await _first_token(w, short, b.engine_name)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert (await _p_to_d(w, prompt, reloaded.engine_name)).token_ids == with_b.token_ids

    # The registry records show what each worker holds (at most max_adapters, least recently used first),
    # from the next heartbeat on.
    expected = (a.engine_name, reloaded.engine_name)
    deadline = time.monotonic() + 10
    while True:
        records = await w.registry.list_workers(model=MODEL)
        if [r.adapters for r in records] == [expected, expected] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    assert [(r.max_adapters, r.adapters) for r in records] == [(2, expected), (2, expected)]

    # The workers stop; one plain vLLM engine with the same adapters answers the same tokens.
    worker_procs.stop()
    plain = _plain_vllm(
        [
            {"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True},
            {"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **_lora(a)},
            {"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **_lora(b)},
            {"prompt_token_ids": turn2, "max_tokens": MAX_TOKENS, "ignore_eos": True, **_lora(a)},
        ]
    )
    assert plain == [base.token_ids, with_a.token_ids, with_b.token_ids, second.token_ids]


def _lora(entry: AdapterEntry) -> dict[str, str]:
    return {"adapter": entry.engine_name, "adapter_path": entry.path}
