"""Two base models in one local stack (issue 40): SmolLM2-135M-Instruct and SmolLM2-135M-Instruct-tandem-merged
(``make model``: the default model with a LoRA adapter merged in, real different weights), each on a vLLM
prefill and a vLLM decode worker of its own, one router, one gateway (``StackConfig.extra_models``, as
``make run RUN_ARGS=--second-model``).

The reference is two plain vLLM OpenAI servers (``tandem.local.plain_vllm``, nothing of Tandem's in them),
one per model, started first and stopped before the stack starts (so this module runs at most four engines
at once). At temperature 0, each model's chat and completion answers through Tandem equal its plain
server's, text and token counts; the two models answer differently; ``/v1/models`` lists both; every worker
registered under its own model. The prompts carry emoji, CJK and accents.

A peer that dies mid-test fails it with its log tail (the stack's start error names the component);
garbage from a peer fails the comparison that reads it. Not this module's subject: faults (tests/faults).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.common.registry import WorkerRegistry
from tandem.local.plain_vllm import start_plain_vllm, stop_plain_vllm
from tandem.local.stack import ExtraModel, LocalStack, StackConfig, default_model_dir, free_port
from tests.kit.adapters import BASE_MODEL_NAME, SECOND_MODEL_NAME, second_model_path

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MAX_TOKENS = 16
CHATS = [
    "Décris la mer 🌊 en une phrase: Zürich → 東京タワー, café crème.",
    "What is the capital of France? Answer in one word.",
]
COMPLETION = "The three primary colours are"


def _chat_body(model: str, content: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def _completion_body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": COMPLETION, "max_tokens": MAX_TOKENS, "temperature": 0}


def _answers(base_url: str, model: str, headers: dict[str, str] | None = None) -> list[tuple[str, str, int]]:
    """(text, finish reason, completion tokens) of every chat, then of the completion."""
    out = []
    bodies = [("/v1/chat/completions", _chat_body(model, c)) for c in CHATS]
    bodies.append(("/v1/completions", _completion_body(model)))
    for path, body in bodies:
        response = httpx.post(f"{base_url}{path}", json=body, headers=headers, timeout=300)
        assert response.status_code == 200, response.text
        result = response.json()
        choice = result["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        out.append((str(text), str(choice["finish_reason"]), int(result["usage"]["completion_tokens"])))
    return out


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    return {BASE_MODEL_NAME: default_model_dir(), SECOND_MODEL_NAME: second_model_path()}


@pytest.fixture(scope="module")
def reference(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[tuple[str, str, int]]]:
    """Each model's answers from its own plain vLLM server (both at once, one core each), then stopped."""
    log_dir = Path(tmp_path_factory.mktemp("plain-vllm"))
    servers = {}
    try:
        for core, (name, model_dir) in enumerate(models.items()):
            port = free_port()
            proc, _ = start_plain_vllm(model_dir, name, port, log_dir / f"{name}.log", cpu_threads_bind=str(core % 2))
            servers[name] = (proc, f"http://127.0.0.1:{port}")
        return {name: _answers(url, name) for name, (_, url) in servers.items()}
    finally:
        for proc, _ in servers.values():
            stop_plain_vllm(proc)


@pytest.fixture(scope="module")
def two_model_stack(
    reference: dict[str, list[tuple[str, str, int]]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-it2m-{uuid.uuid4().hex[:8]}",
        log_dir=Path(tmp_path_factory.mktemp("two-model-logs")),
        extra_models=[ExtraModel.free(second_model_path(), SECOND_MODEL_NAME)],
        # Every chat here goes through the handoff (prefill -> decode, KV pulled), as in test_text_fidelity.
        min_uncached_tokens_to_disaggregate=16,
        # 256 MiB of KV per engine (these prompts need a few blocks) rather than 1 GiB: this module's four
        # engines may run beside the session's stack (two more) on a 24 GiB CI host.
        kv_cache_bytes=256 << 20,
    )
    stack = LocalStack(config, progress=lambda msg: print(f"[stack] {msg}", flush=True))
    try:
        stack.start()
    except BaseException:
        for name in ("router", *config.worker_ports(), "gateway"):
            print(f"--- {name} log tail ---\n{stack.tail(name)}")
        stack.stop()
        raise
    yield stack
    stack.stop()


def test_each_models_answer_equals_its_plain_vllm_and_the_models_differ(
    two_model_stack: LocalStack, reference: dict[str, list[tuple[str, str, int]]]
) -> None:
    url, headers = two_model_stack.config.gateway_url, two_model_stack.auth_headers
    tandem = {name: _answers(url, name, headers) for name in reference}
    for name, answers in tandem.items():
        assert answers == reference[name], name
    base, second = tandem[BASE_MODEL_NAME], tandem[SECOND_MODEL_NAME]
    # Different weights answer differently (a short factual answer may still coincide, so: not all alike).
    assert any(a[0] != b[0] for a, b in zip(base, second, strict=True)), (base, second)


def test_models_lists_both_and_each_worker_serves_its_own_model(two_model_stack: LocalStack) -> None:
    config = two_model_stack.config
    response = httpx.get(f"{config.gateway_url}/v1/models", headers=two_model_stack.auth_headers, timeout=10)
    assert response.status_code == 200
    assert {c["id"] for c in response.json()["data"]} == {BASE_MODEL_NAME, SECOND_MODEL_NAME}
    unknown = httpx.post(
        f"{config.gateway_url}/v1/chat/completions",
        json=_chat_body("SmolLM2-135M-Instruct-🗼", "hi"),
        headers=two_model_stack.auth_headers,
        timeout=10,
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

    async def records() -> dict[str, str]:
        login = two_model_stack.redis_logins.get("worker")
        url = login.url(config.redis_url) if login is not None else config.redis_url
        registry = WorkerRegistry(url, key_prefix=config.key_prefix)
        try:
            return {w.worker_id: w.model for w in await registry.list_workers()}
        finally:
            await registry.aclose()

    by_id = asyncio.run(records())
    expected = {two_model_stack.worker_ids[name]: config.worker_model(name)[0] for name in config.worker_ports()}
    assert by_id == expected
