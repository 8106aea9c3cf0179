"""No request body gets a 5xx (issue 38): hypothesis, driven from the gateway's own /openapi.json through
schemathesis, sends ``FUZZ_EXAMPLES`` generated requests (valid by the schema and not, half each, on the
generation endpoints; 10,000 by default) to the real app. Behind it, the fake workers run the real
workers' own field checks (:mod:`tandem.worker.validation`, against the test tokenizer's vocabulary), so a
field the gateway passes on and a worker would refuse is a 400 here as it is in production. Every answer
must be 200 or a 4xx in the endpoint's error shape (OpenAI's; Anthropic's on ``/v1/messages``).

The same property runs against a real stack (real engines) in ``tests/faults/test_hostile_input.py``."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import grpc
import pytest

from tandem.v1 import worker_pb2
from tandem.worker.validation import ModelLimits, check_decode, check_prefetch, check_prefill
from tests.kit.fuzz import GENERATION_PATHS, error_shape
from tests.kit.gateway import DecodeStep, FakeWorker

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

#: Requests in all, over both endpoints and both generation modes.
FUZZ_EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "10000"))
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class ValidatingWorker(FakeWorker):
    """A fake worker that refuses what a real one refuses, with the real checks (INVALID_ARGUMENT). Its
    own tokens are of the test tokenizer's vocabulary (the decode worker checks the first one)."""

    first_token_id: int = 3
    decode_steps: list[DecodeStep] = field(
        default_factory=lambda: [DecodeStep(" x", [4]), DecodeStep("!", [5], "stop")]
    )

    limits: ClassVar[ModelLimits] = ModelLimits(vocab_size=0, max_model_len=64, max_logprobs=20, block_size_tokens=4)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: Any) -> worker_pb2.PrefillResponse:
        error = check_prefill(request, self.limits)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        return await super().Prefill(request, context)

    async def Decode(self, request: worker_pb2.DecodeRequest, context: Any) -> Any:
        error = check_decode(request, self.limits)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        async for chunk in super().Decode(request, context):
            yield chunk

    async def PrefetchKV(self, request: worker_pb2.PrefetchKVRequest, context: Any) -> worker_pb2.PrefetchKVResponse:
        error = check_prefetch(request, self.limits)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        return await super().PrefetchKV(request, context)


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    """Every generated request comes from one key: each must meet its own answer, not the 429 of a key over
    its refused requests (tests/unit/gateway/test_rejections.py). Redis gets 5 s rather than the default
    0.5 s to answer the key lookup: this test is about request bodies, and on the loaded 2-core CI host a
    0.5 s stall of the shared Redis once made one of 10,000 requests a (correct) 503 backend_unavailable.
    That 503 has its own tests (test_redis_client.py here, tests/faults/backend/test_restarts.py)."""
    return {"auth": {"max_rejected_requests_per_minute": 0}, "tenancy": {"redis_timeout_s": 5.0}}


def test_openapi_document_lists_the_endpoints() -> None:
    from tandem.gateway.api.openapi import build_document

    document = build_document()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/usage"} <= set(document["paths"])
    assert "ChatCompletionRequest" in document["components"]["schemas"]
    # The wire's widths are in the schema, so that generated values reach past them.
    fields = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert fields["min_tokens"]["exclusiveMaximum"] == 2**32


async def test_no_request_body_gets_a_5xx(edge: Any, edge_url: str, start_worker: Any, prompt_tokenizer: Any) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.core import NotSet
    from schemathesis.generation import GenerationMode

    ValidatingWorker.limits = ModelLimits(
        vocab_size=prompt_tokenizer.vocab_size, max_model_len=64, max_logprobs=20, block_size_tokens=4
    )
    prefill = await start_worker("prefill-v", worker_cls=ValidatingWorker)
    decode = await start_worker("decode-v", worker_cls=ValidatingWorker)
    edge.router.placements[:] = [_placement(prefill, decode)]
    key = await edge.tenant("fuzz")
    loop = asyncio.get_running_loop()
    failures: list[str] = []
    statuses: dict[int, int] = {}
    per_run = max(1, FUZZ_EXAMPLES // (2 * len(GENERATION_PATHS)))

    async def send(method: str, path: str, body: Any, headers: dict[str, str]) -> Any:
        content = body if isinstance(body, bytes) else json.dumps(body, default=str).encode()
        return await edge.client.request(method, path, content=content, headers=headers, timeout=20)

    def fuzz(op: Any, mode: Any) -> None:
        @settings(max_examples=per_run, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy(generation_mode=mode))
        def check(case: Any) -> None:
            headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
            body = None if isinstance(case.body, NotSet) else case.body
            if mode == GenerationMode.POSITIVE and isinstance(body, dict):
                body["model"] = MODEL  # else nearly every valid body is a 404 for an unknown model
            future = asyncio.run_coroutine_threadsafe(send(op.method.upper(), op.path, body, headers), loop)
            response = future.result(60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            status = response.status_code
            wrong = status >= 500 or (status != 200 and error_shape(op.path, status, response.content))
            if wrong:
                failures.append(
                    f"{op.path} {mode.value}: {response.status_code} {response.text[:200]} body={str(case.body)[:300]}"
                )

        check()

    def run() -> None:  # in a thread: hypothesis drives, the app answers on this test's loop
        schema = schemathesis.openapi.from_url(f"{edge_url}/openapi.json")
        for operation in schema.get_all_operations():
            op = operation.ok()
            if op.path in GENERATION_PATHS:
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    fuzz(op, mode)

    await asyncio.to_thread(run)
    print(f"openapi-fuzz: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= FUZZ_EXAMPLES * 0.9, statuses
    assert statuses.get(200, 0) > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0, statuses
    assert not failures, failures[:20]


def _placement(prefill: FakeWorker, decode: FakeWorker) -> Any:
    from tests.kit.gateway import placement

    return placement(prefill, decode)
