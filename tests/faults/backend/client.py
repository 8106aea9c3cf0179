"""A small OpenAI-API client for the back-end fault tests: streamed chat
completions read line by line, so a test can act (kill a worker) in the
middle of a stream and then see exactly what the client got."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tandem.local.stack import LocalStack
from tests.probes import StreamResult, read_sse

PROMPT = "Write a long story about a lighthouse keeper who finds a map."


def chat_body(stack: LocalStack, content: str = PROMPT, *, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": stack.config.served_model_name,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra)
    return body


def stream_chat(
    stack: LocalStack,
    body: dict[str, Any],
    *,
    on_line: Callable[[list[str]], None] | None = None,
    timeout_s: float = 120.0,
    headers: dict[str, str] | None = None,
    gateway_url: str = "",
) -> StreamResult:
    """POST a streamed chat completion (to the stack's gateway, or ``gateway_url``); ``on_line`` sees the
    lines so far after each one."""
    lines: list[str] = []
    with (
        httpx.Client(base_url=gateway_url or stack.config.gateway_url, timeout=timeout_s) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers or stack.auth_headers) as resp,
    ):
        if resp.status_code != 200:
            resp.read()
            return StreamResult(status=resp.status_code, body=resp.text, errors=[_error_of(resp)])
        for line in resp.iter_lines():
            lines.append(line)
            if on_line is not None:
                on_line(lines)
    result = read_sse(lines)
    return result


def _error_of(resp: httpx.Response) -> dict[str, Any]:
    try:
        error: dict[str, Any] = resp.json()["error"]
    except Exception:
        return {"message": resp.text[:200], "retry_after": resp.headers.get("retry-after")}
    return {**error, "retry_after": resp.headers.get("retry-after")}


def num_content_events(lines: list[str]) -> int:
    return sum(1 for line in lines if line.startswith("data:") and '"content"' in line)


def usage_total(stack: LocalStack, headers: dict[str, str] | None = None) -> dict[str, int]:
    """The key's tenant's all-time usage counters (GET /v1/usage)."""
    resp = httpx.get(f"{stack.config.gateway_url}/v1/usage", headers=headers or stack.auth_headers, timeout=10)
    resp.raise_for_status()
    total: dict[str, int] = resp.json()["total"]
    return total


def gateway_counter(stack: LocalStack, metric: str, **labels: str) -> float:
    text = httpx.get(f"{stack.config.gateway_url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(metric):
            continue
        name, _, value = line.rpartition(" ")
        if name.split("{")[0] != metric:
            continue
        if all(f'{k}="{v}"' in name for k, v in labels.items()):
            total += float(value)
    return total


class Stopwatch:
    def __init__(self) -> None:
        self.started_s = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_s
