"""A fake OpenAI-compatible streaming server as an httpx transport (no sockets).

Behaviour by bearer key: ``sk-429`` gets 429 with Retry-After, ``sk-500`` a
500; every other request streams ``max_tokens`` content chunks (role chunk
first, then finish, usage and [DONE]) after ``ttft_s``, one every ``gap_s``.
``ttft_per_in_flight_s`` adds that much to the TTFT per other request in flight
(a simulated server that slows as its load rises, for the capacity sweep's tests).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class FakeOpenAIServer:
    ttft_s: float = 0.02
    gap_s: float = 0.005
    ttft_per_in_flight_s: float = 0.0
    requests: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    num_disconnected: int = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((dict(request.headers), body))
        key = request.headers.get("authorization", "")
        if key == "Bearer sk-429":
            return httpx.Response(429, headers={"Retry-After": "2"}, json={"error": {"message": "slow down"}})
        if key == "Bearer sk-500":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._stream(body, "messages" in body))

    async def _stream(self, body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        finished = False
        try:
            await asyncio.sleep(self.ttft_s + self.ttft_per_in_flight_s * (self.in_flight - 1))
            if chat:
                yield _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            n = int(body["max_tokens"])
            for i in range(n):
                if i:
                    await asyncio.sleep(self.gap_s)
                piece = f" t{i}"
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                yield _event({"choices": [choice]})
            yield _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            yield _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}})
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            self.in_flight -= 1
            if not finished:
                self.num_disconnected += 1


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
