"""Background responses (``background: true``) on the real stack with the real ``openai`` SDK: created, polled
with ``retrieve`` until completed, with the foreground answer's text at temperature 0; a long one cancelled
while it generates is ``cancelled`` and the engines, the KV servers and the router then hold nothing for it
(the fault suite's probes: ``tests.probes.quiesce`` and ``router_budget_tokens``); and a second gateway
process, killed (SIGKILL) while it generates one, leaves a record that reads ``failed`` once its lease ends,
through the first gateway. A streamed one whose client drops the create's stream after a few events is resumed
with ``retrieve(stream=True, starting_after=N)``: exactly the rest, with the uninterrupted answer's text. The
text carries accents, CJK, an emoji and the chat template's control tokens."""

from __future__ import annotations

import signal
import time

import openai
import pytest
from openai.types.responses import Response

from tandem.local.stack import LocalStack
from tests.kit.net import free_port
from tests.probes import quiesce, router_budget_tokens, wait_until

pytestmark = pytest.mark.integration

QUESTION = "Raconte une très longue histoire 📚 sur le pain — 面包的历史 <|im_start|>system, en détail."
#: The lease of the gateway that is killed (the default is 10 s).
LEASE_S = 2.0


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _poll(client: openai.OpenAI, response_id: str, until: tuple[str, ...], timeout_s: float) -> Response:
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in until or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_background_completes_and_a_cancel_releases_everything(stack: LocalStack) -> None:
    model = stack.config.served_model_name
    client = _client(stack.config.gateway_url, stack.api_key)
    request = {"model": model, "input": QUESTION, "max_output_tokens": 16, "temperature": 0}
    foreground = client.responses.create(**request, store=False)  # type: ignore[call-overload]
    created = client.responses.create(**request, background=True)  # type: ignore[call-overload]
    assert created.status == "queued" and created.background is True and created.output == []
    done = _poll(client, created.id, ("completed", "incomplete", "failed", "cancelled"), 120)
    assert done.status == foreground.status, done.error
    assert done.output_text == foreground.output_text and done.background is True
    assert done.usage is not None and foreground.usage is not None
    assert done.usage.output_tokens == foreground.usage.output_tokens

    # A long answer, cancelled as soon as it generates.
    long = client.responses.create(model=model, input=QUESTION, max_output_tokens=1500, background=True)
    running = _poll(client, long.id, ("in_progress", "completed", "incomplete", "failed"), 120)
    assert running.status == "in_progress", running.status
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"
    residue = quiesce(stack, timeout_s=30)
    assert all(r.total == 0 for r in residue.values()), residue  # no request, no KV block held anywhere
    assert wait_until(lambda: router_budget_tokens(stack) == 0, timeout_s=30), router_budget_tokens(stack)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input=QUESTION, background=True, store=False)
    assert refused.value.param == "background"


def test_a_killed_gateway_leaves_a_failed_record_after_its_lease(stack: LocalStack) -> None:
    """A real second gateway process generates a background response and is SIGKILLed mid-generation; the
    first gateway answers the record ``failed`` once the dead one's lease ended, not ``in_progress`` forever."""
    name = f"gateway-bg-{free_port()}"
    url = stack.start_gateway_variant(name, free_port(), {"TANDEM_GATEWAY_TENANCY__BACKGROUND_LEASE_S": str(LEASE_S)})
    doomed = _client(url, stack.api_key)
    survivor = _client(stack.config.gateway_url, stack.api_key)
    model = stack.config.served_model_name
    created = doomed.responses.create(model=model, input=QUESTION, max_output_tokens=1500, background=True)
    running = _poll(survivor, created.id, ("in_progress", "completed", "incomplete", "failed"), 120)
    assert running.status == "in_progress", running.status
    stack.kill(name, signal.SIGKILL)
    killed_at = time.monotonic()
    assert survivor.responses.retrieve(created.id).status == "in_progress"  # its lease runs on a while
    failed = _poll(survivor, created.id, ("failed", "completed", "incomplete", "cancelled"), 30)
    assert failed.status == "failed" and failed.error is not None, failed.status
    assert failed.error.code == "server_error" and "stopped before it finished" in failed.error.message
    assert time.monotonic() - killed_at <= LEASE_S + 5
    assert survivor.responses.retrieve(created.id).status == "failed"  # written, not only answered
    # The dead gateway's request: the router's lease and the workers' own clean-up let go of it.
    residue = quiesce(stack, timeout_s=60)
    assert all(r.total == 0 for r in residue.values()), residue


def test_a_dropped_background_stream_resumes_with_exactly_the_rest(stack: LocalStack) -> None:
    """The real SDK's create(background=True, stream=True), dropped after six events; the resume gets the events
    after the last one read, contiguous, ending with the answer the same request gets uninterrupted."""
    model = stack.config.served_model_name
    client = _client(stack.config.gateway_url, stack.api_key)
    request = {"model": model, "input": QUESTION, "max_output_tokens": 48, "temperature": 0}
    whole = client.responses.create(**request, store=False)  # type: ignore[call-overload]
    stream = client.responses.create(**request, background=True, stream=True)  # type: ignore[call-overload]
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 6:
            break
    stream.close()
    response_id = seen[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    every = seen + rest
    assert [e.sequence_number for e in every] == list(range(len(every)))
    assert rest[-1].type in ("response.completed", "response.incomplete"), rest[-1].type
    text = "".join(e.delta for e in every if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text == whole.output_text and text
    assert client.responses.retrieve(response_id).output_text == whole.output_text
