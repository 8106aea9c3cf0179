"""Sends one streamed request and records its timing.

Called by :mod:`tandem_loadtest.runner`; calls httpx. :class:`StreamParser`
is the pure part (SSE lines in, record fields out) so that it can be tested
on recorded streams with recorded timestamps.

What counts (the same as ``vllm bench serve`` where the two agree, see
``docs/loadtest.md``): the clock starts just before the POST; a *content
chunk* is an SSE event whose first choice has non-empty ``delta.content``
(chat) or ``text`` (completions), so role-only, finish-only and usage-only
chunks never count as tokens; token counts come from the usage chunk only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from tandem_loadtest.records import RequestRecord
from tandem_loadtest.workloads import RequestSpec


class StreamParser:
    """Feeds SSE lines (with the time each arrived, s since send) into a record."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.text_parts: list[str] = []
        self.done = False
        self._data: list[str] = []

    def feed_line(self, line: str, now_s: float) -> None:
        """One line of the event stream; a blank line ends an event."""
        if line == "":
            self._dispatch(now_s)
        elif line.startswith("data:"):
            self._data.append(line[5:].lstrip(" "))
        # Comments (":ping"), "event:", "id:" and "retry:" lines carry no tokens.

    def close(self, now_s: float) -> None:
        self._dispatch(now_s)

    def _dispatch(self, now_s: float) -> None:
        if not self._data:
            return
        payload = "\n".join(self._data)
        self._data = []
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(payload)
        except ValueError:
            self._fail(f"bad SSE payload: {payload[:200]}")
            return
        if not isinstance(event, dict):
            return
        if "error" in event and not event.get("choices"):
            err = event["error"]
            self._fail(f"stream error: {err.get('message', err) if isinstance(err, dict) else err}")
            return
        choices = event.get("choices") or []
        if not isinstance(choices, list) or (choices and not isinstance(choices[0], dict)):
            self._fail(f"malformed event: {payload[:200]}")
            return
        if choices:
            choice = choices[0]
            delta = choice.get("delta")
            content = (
                (delta if isinstance(delta, dict) else {}).get("content") if delta is not None else choice.get("text")
            )
            if not isinstance(content, str):
                content = None
            if content:
                self.record.content_times_s.append(now_s)
                self.text_parts.append(content)
                self.record.output_chars += len(content)
            if isinstance(choice.get("finish_reason"), str) and choice["finish_reason"]:
                self.record.finish_reason = choice["finish_reason"]
            self.record.last_choice_s = now_s
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.record.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
            self.record.completion_tokens = _int_or_none(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                self.record.cached_tokens = _int_or_none(details.get("cached_tokens"))

    def _fail(self, message: str) -> None:
        if self.record.error is None:
            self.record.error = message


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or abs(value) == float("inf"):
        return None
    return int(value)


def build_body(spec: RequestSpec, model: str, *, ignore_eos: bool, temperature: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    if temperature is not None:
        body["temperature"] = temperature
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM extension: exactly max_tokens tokens
    return body


async def send_request(
    client: httpx.AsyncClient,
    record: RequestRecord,
    body: dict[str, Any],
    *,
    api_key: str | None,
    clock: Callable[[], float] = time.perf_counter,
) -> str:
    """Send ``body`` and fill ``record``; returns the streamed text. Never raises
    (except for the task's own cancellation): every failure is a status."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    parser = StreamParser(record)
    sent = clock()
    try:
        if record.cancel_after_s is not None:
            async with asyncio.timeout(record.cancel_after_s):
                await _stream(client, path, body, headers, parser, sent, clock)
        else:
            await _stream(client, path, body, headers, parser, sent, clock)
    except TimeoutError:
        if record.cancel_after_s is not None and record.http_status in (None, 200) and not parser.done:
            record.status = "cancelled"
            record.end_s = clock() - sent
            return "".join(parser.text_parts)
        record.status, record.error = "error", record.error or "timeout"
    except httpx.TimeoutException as exc:
        record.status, record.error = "error", f"timeout: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        record.status, record.error = "error", f"{type(exc).__name__}: {exc}"
    record.end_s = clock() - sent
    return "".join(parser.text_parts)


async def _stream(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    parser: StreamParser,
    sent: float,
    clock: Callable[[], float],
) -> None:
    record = parser.record
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        record.http_status = resp.status_code
        if resp.status_code != 200:
            raw = (await resp.aread()).decode(errors="replace")
            record.error = f"HTTP {resp.status_code}: {raw[:300]}"
            if resp.status_code == 429:
                record.status = "rate_limited"
                retry_after = resp.headers.get("retry-after")
                if retry_after is not None:
                    try:
                        record.retry_after_s = float(retry_after)
                    except ValueError:
                        pass
            else:
                record.status = "error"
            return
        async for line in resp.aiter_lines():
            parser.feed_line(line, clock() - sent)
        parser.close(clock() - sent)
    if record.error is not None:
        record.status = "error"
    elif not record.content_times_s:
        record.status, record.error = "error", "stream ended without content"
    else:
        record.status = "ok"
