"""A request's generated-token count, written to its open usage record off the token path.

Called by the generation response (:meth:`ProgressWriter.advance` before each chunk goes to the
client, :meth:`ProgressWriter.close` when the request ends); calls
:meth:`tandem.gateway.usage.UsageStore.progress` from its own task. A stream used to wait for one Redis
write per chunk, so a Redis stall stalled every stream; now a chunk waits only when the open record
lags the client by more than ``max_unsaved_tokens``, which bounds what a gateway killed during a
Redis stall can leave unbilled (the sweeper settles its record with the count last written). Writes
are coalesced: at most one in flight, then at most one per ``interval_s``.

A write that fails (Redis down, not slow) is logged and counted as done, as before: the final record
retries on its own, and only a gateway killed during the outage bills less.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from tandem.common.errors import BackendUnavailableError

logger = logging.getLogger(__name__)


class ProgressWriter:
    def __init__(
        self,
        save: Callable[[int], Awaitable[None]],
        *,
        interval_s: float,
        max_unsaved_tokens: int,
        request_id: str = "",
    ) -> None:
        self._save = save
        self._interval_s = interval_s
        self._max_unsaved_tokens = max_unsaved_tokens
        self._request_id = request_id
        #: Tokens the client may have been sent; tokens the record holds (or a failed write gave up on).
        self.num_target_tokens = 0
        self.num_saved_tokens = 0
        self._wake = asyncio.Event()
        self._caught_up = asyncio.Event()
        self._caught_up.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def advance(self, num_tokens: int) -> None:
        """The client is about to be sent ``num_tokens`` in all: have them written, waiting only while the
        record lags by more than ``max_unsaved_tokens``."""
        if self._closed or num_tokens <= self.num_target_tokens:
            return
        self.num_target_tokens = num_tokens
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"usage-progress-{self._request_id}")
        self._wake.set()
        if num_tokens - self.num_saved_tokens > self._max_unsaved_tokens:
            self._caught_up.clear()
            await self._caught_up.wait()

    def close(self) -> None:
        """The request ended (its final record supersedes the open one): stop writing. A write in flight
        is left to finish, not cancelled (redis-py may swallow a cancellation that lands mid-command, and
        the task would then wait forever); landing after the final record, it changes nothing."""
        self._closed = True
        self._wake.set()
        self._caught_up.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            target = self.num_target_tokens
            try:
                await self._save(target)
            except BackendUnavailableError as exc:
                logger.warning("usage progress not saved: %s", exc, extra={"request_id": self._request_id})
            self.num_saved_tokens = max(self.num_saved_tokens, target)
            if self.num_target_tokens - self.num_saved_tokens <= self._max_unsaved_tokens:
                self._caught_up.set()
            if self.num_target_tokens > self.num_saved_tokens:
                self._wake.set()
            await asyncio.sleep(self._interval_s)
