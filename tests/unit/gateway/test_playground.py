"""The playground at / in headless Debian chromium, driven by Playwright: type a
question, see streamed text, press Stop, and the server aborts the request."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from .conftest import DecodeStep

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="needs chromium (make browser)")
async def test_playground_streams_and_stop_aborts_the_generation(edge: Any, edge_url: str, wait: Any) -> None:
    from playwright.async_api import async_playwright

    key = await edge.tenant("browser")
    edge.decode.decode_steps = [DecodeStep(f" word{i}", [5]) for i in range(400)] + [DecodeStep("!", [6], "stop")]
    edge.decode.decode_step_delay_s = 0.05
    page_html = (await edge.client.get("/")).text
    assert ".innerHTML" not in page_html and "getReader" in page_html
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(edge_url + "/")
            await page.fill("#key", key)
            await page.dispatch_event("#key", "change")
            await page.fill("#model", "SmolLM2-135M-Instruct")
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
        finally:
            await browser.close()
    await edge.settled()
    usage = (await edge.client.get("/v1/usage", headers={"Authorization": f"Bearer {key}"})).json()["total"]
    assert usage["aborted_requests"] == 1
