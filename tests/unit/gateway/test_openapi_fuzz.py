"""No request body gets a 5xx (issue 38): hypothesis, driven from the gateway's own /openapi.json through
schemathesis (:func:`tests.kit.fuzz.fuzz_endpoint`, in a thread beside the app's loop), sends
``FUZZ_EXAMPLES`` generated requests (valid by the schema and not, half each, on the generation endpoints;
10,000 by default) to the real app. Behind it, the fake workers run the real workers' own field
checks (:mod:`tandem.worker.validation`, against the test tokenizer's vocabulary), so a field the gateway
passes on and a worker would refuse is a 400 here as it is in production. Every answer must be 200 or a 4xx
in the endpoint's error shape (OpenAI's; Anthropic's on ``/v1/messages``).

The same property runs against a real stack (real engines) in ``tests/faults/test_hostile_input.py``."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import grpc
import pytest

from tandem.v1 import worker_pb2
from tandem.worker.validation import ModelLimits, check_decode, check_prefetch, check_prefill
from tests.kit.fuzz import GENERATION_PATHS, FuzzResult, fuzz_endpoint
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
    ValidatingWorker.limits = ModelLimits(
        vocab_size=prompt_tokenizer.vocab_size, max_model_len=64, max_logprobs=20, block_size_tokens=4
    )
    prefill = await start_worker("prefill-v", worker_cls=ValidatingWorker)
    decode = await start_worker("decode-v", worker_cls=ValidatingWorker)
    edge.router.placements[:] = [_placement(prefill, decode)]
    key = await edge.tenant("fuzz")
    per_run = max(1, FUZZ_EXAMPLES // (2 * len(GENERATION_PATHS)))
    loop = asyncio.get_running_loop()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def send(method: str, path: str, content: bytes) -> tuple[int, bytes]:
        """To the app in this process (no socket), on the test's loop: the generation, not the app, takes most
        of the time, and an HTTP hop per request doubled it (measured at 2,400 requests: 174 against 91 s)."""
        request = edge.client.request(method, path, content=content, headers=headers, timeout=20)
        response = asyncio.run_coroutine_threadsafe(request, loop).result(60)
        return response.status_code, response.content

    def run() -> list[FuzzResult]:  # in a thread: hypothesis drives, the app answers on this test's loop
        return [
            fuzz_endpoint(f"{edge_url}/openapi.json", path, send, negative=negative, examples=per_run, model=MODEL)
            for path in GENERATION_PATHS
            for negative in (False, True)
        ]

    results = await asyncio.to_thread(run)
    total = FuzzResult()
    for result in results:
        total.add(result)
    statuses = total.statuses
    print(f"openapi-fuzz: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= FUZZ_EXAMPLES * 0.9, statuses
    assert statuses.get(200, 0) > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0, statuses
    assert not total.wrong, total.wrong[:20]


def _placement(prefill: FakeWorker, decode: FakeWorker) -> Any:
    from tests.kit.gateway import placement

    return placement(prefill, decode)
