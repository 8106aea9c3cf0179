"""The playground at / in headless Debian chromium, driven by Playwright: type a
question, see streamed text, press Stop, and the server aborts the request; the
sampling controls reach the request body and the workers, and an empty control
is left out so the server's default applies."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.browser import CHROMIUM, CHROMIUM_ARGS
from tests.kit.gateway import DecodeStep

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

#: What the page's "Max tokens" control holds when it loads.
PAGE_MAX_TOKENS = 256
needs_chromium = pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="needs chromium (make browser)")


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    # Room for the page's default max_tokens (the shared settings allow 64 tokens of context).
    return {"max_model_len": 1024, "default_max_tokens": 16}


@contextlib.asynccontextmanager
async def playground(url: str, key: str, sent_bodies: list[dict[str, Any]]) -> AsyncIterator[Any]:
    """A chromium page on the playground with ``key`` entered; every chat request body lands in ``sent_bodies``."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()

            def record(request: Any) -> None:
                if request.url.endswith("/v1/chat/completions"):
                    sent_bodies.append(json.loads(request.post_data))

            page.on("request", record)
            await page.goto(url + "/")
            await page.get_by_label("API key").fill(key)
            await page.dispatch_event("#key", "change")
            await page.get_by_label("Model").fill("SmolLM2-135M-Instruct")
            yield page
        finally:
            await browser.close()


async def ask(page: Any, text: str) -> None:
    """Send ``text`` in a new conversation and wait until the answer finished streaming."""
    await page.click("#reset")
    await page.get_by_label("Message").fill(text)
    await page.click("#send")
    await page.wait_for_function(
        "() => document.querySelector('.turn.assistant, .turn.error')"
        " && !['waiting', 'streaming'].includes(document.getElementById('status').textContent)",
        timeout=30000,
    )
    assert await page.text_content("#status") == "done", await page.text_content("#log")


@needs_chromium
async def test_playground_streams_and_stop_aborts_the_generation(edge: Any, edge_url: str, wait: Any) -> None:
    key = await edge.tenant("browser")
    edge.decode.decode_steps = [DecodeStep(f" word{i}", [5]) for i in range(400)] + [DecodeStep("!", [6], "stop")]
    edge.decode.decode_step_delay_s = 0.05
    page_html = (await edge.client.get("/")).text
    assert ".innerHTML" not in page_html and "getReader" in page_html
    sent_bodies: list[dict[str, Any]] = []
    async with playground(edge_url, key, sent_bodies) as page:
        await page.fill("#question", "hello there")
        await page.click("#send")
        answer = page.locator(".turn.assistant").last
        await page.wait_for_function(
            "() => (document.querySelector('.turn.assistant')?.textContent || '').includes('word5')", timeout=30000
        )
        assert (await answer.text_content() or "").startswith("Hello word0")
        assert (await page.text_content("#ttft") or "").endswith("ms")
        await page.click("#stop")
        await page.wait_for_function("() => document.getElementById('status').textContent === 'stopped'")
        await wait(edge.decode.aborted_event, 10)  # the server aborted the generation behind it
        shown = await answer.text_content() or ""
        assert "word399" not in shown
    await edge.settled()
    usage = (await edge.client.get("/v1/usage", headers={"Authorization": f"Bearer {key}"})).json()["total"]
    assert usage["aborted_requests"] == 1
    # Untouched controls: the page's max tokens, and no temperature, so the model's default applies.
    [body] = sent_bodies
    assert body["stream"] is True and body["max_tokens"] == PAGE_MAX_TOKENS and "temperature" not in body
    assert edge.router.schedule_calls[-1]["max_tokens"] == PAGE_MAX_TOKENS
    assert not edge.prefill.prefill_requests[-1].sampling.HasField("temperature")


@needs_chromium
async def test_sampling_controls_reach_the_request_and_empty_ones_are_left_out(edge: Any, edge_url: str) -> None:
    key = await edge.tenant("browser")
    sent_bodies: list[dict[str, Any]] = []
    async with playground(edge_url, key, sent_bodies) as page:
        temperature, max_tokens = page.get_by_label("Temperature"), page.get_by_label("Max tokens")
        assert await temperature.input_value() == ""  # the model's default until the user sets one
        assert await max_tokens.input_value() == str(PAGE_MAX_TOKENS)

        await temperature.fill("0.7")
        await max_tokens.fill("32")
        await ask(page, "hello there")
        assert sent_bodies[-1]["temperature"] == 0.7 and sent_bodies[-1]["max_tokens"] == 32
        assert edge.prefill.prefill_requests[-1].sampling.temperature == pytest.approx(0.7)
        assert edge.decode.decode_requests[-1].sampling.temperature == pytest.approx(0.7)
        assert edge.router.schedule_calls[-1]["max_tokens"] == 32

        await temperature.fill("")
        await max_tokens.fill("")
        await ask(page, "how are you")
        assert "temperature" not in sent_bodies[-1] and "max_tokens" not in sent_bodies[-1]
        assert not edge.prefill.prefill_requests[-1].sampling.HasField("temperature")
        assert edge.router.schedule_calls[-1]["max_tokens"] == 16  # the gateway's default_max_tokens

        await temperature.fill("2.5")  # out of range: the page says so and sends nothing
        await page.get_by_label("Message").fill("one two")
        await page.click("#send")
        await page.wait_for_function("() => document.getElementById('status').textContent === 'not sent'")
        assert "from 0 to 2" in (await page.locator(".turn.error").last.text_content() or "")
        assert await page.get_by_label("Message").input_value() == "one two"  # kept, to send once fixed
        assert len(sent_bodies) == 2
    await edge.settled()
