"""The open usage record's progress is written off the token path (issue 38: every streamed chunk waited on a
Redis write, so a Redis stall stalled every stream): a stalled write holds no token until the record lags by
more than the bound; then the stream waits, and goes on once the write lands."""

from __future__ import annotations

import asyncio

import pytest

from tandem.common.errors import BackendUnavailableError
from tandem.gateway.usage_progress import ProgressWriter

pytestmark = [pytest.mark.timeout(30)]


class StallingStore:
    """A Redis write that can be held (a stall) or made to fail (an outage)."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.failing = False

    async def save(self, num_tokens: int) -> None:
        await self.flowing.wait()
        if self.failing:
            raise BackendUnavailableError("redis down")
        self.written.append(num_tokens)


async def test_tokens_flow_while_a_write_stalls_until_the_bound() -> None:
    store = StallingStore()
    writer = ProgressWriter(store.save, interval_s=0.01, max_unsaved_tokens=5, request_id="r")
    await writer.advance(1)
    await asyncio.sleep(0.05)
    assert store.written == [1]
    store.flowing.clear()  # Redis stalls
    for n in range(2, 7):  # within the bound: no token waits
        await asyncio.wait_for(writer.advance(n), 0.1)
    blocked = asyncio.create_task(writer.advance(7))  # 7 - 1 saved > 5: waits for the record
    await asyncio.sleep(0.1)
    assert not blocked.done()
    store.flowing.set()
    await asyncio.wait_for(blocked, 1.0)
    await asyncio.sleep(0.1)
    assert store.written[-1] == 7 and store.written == sorted(store.written)
    assert len(store.written) <= 4  # coalesced: not one write per token
    writer.close()


async def test_a_failed_write_is_given_up_not_waited_on() -> None:
    store = StallingStore()
    store.failing = True
    writer = ProgressWriter(store.save, interval_s=0.01, max_unsaved_tokens=2, request_id="r")
    for n in range(1, 20):
        await asyncio.wait_for(writer.advance(n), 1.0)
    writer.close()
    assert store.written == []


async def test_close_stops_writing() -> None:
    store = StallingStore()
    writer = ProgressWriter(store.save, interval_s=0.01, max_unsaved_tokens=100, request_id="r")
    await writer.advance(3)
    await asyncio.sleep(0.05)
    writer.close()
    await writer.advance(9)  # after the end (a late chunk): nothing is written any more
    await asyncio.sleep(0.05)
    assert store.written == [3]
