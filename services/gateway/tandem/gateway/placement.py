"""Placing one request on the router, and placing it again when a worker died under it.

Called by :class:`tandem.gateway.orchestrator.Orchestrator`; calls the router through a
:class:`~tandem.gateway.router.Router`:

* :meth:`Placer.place`: ``Schedule``, asked again while the router is unreachable;
* :meth:`Placer.replace_decode_worker`: the decode worker was gone before its first token: another
  one, decode-only, with the prefill worker that holds the KV (the KV moves from there as before);
* :meth:`Placer.migrate_decode`: the decode worker died mid-stream: another one, decode-only, that
  computes the prompt and resumes after the tokens sent (the orchestrator's ``Decode`` says so);
* :meth:`Placer.end_reservation`: ``Release``, which ends the request's budget reservation in the router
  (the router's name for it too), retried in the background by cleanup.

The state a request's placements share (the placement now, the prompt's block hashes, the workers
that died under it) is a :class:`Placing`; the orchestrator's per-request progress is one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from tandem.common.backoff import backoff_delays
from tandem.common.errors import BackendUnavailableError, TandemError
from tandem.gateway.job import GenerationJob
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.prefix_hashes import PromptHasher
from tandem.gateway.router import Router
from tandem.v1 import router_pb2

logger = logging.getLogger(__name__)

#: How long cleanup keeps retrying a router Release (ending the reservation) that failed or timed out (it runs
#: in the background).
END_RESERVATION_RETRY_S = 30.0


@dataclass
class Placing:
    """Where one request is placed, and what its next placement must know."""

    placement: router_pb2.Placement | None = None
    #: The prompt's block hashes, computed for its first Schedule and sent again with any retry.
    prompt_block_hashes: list[router_pb2.PromptBlockHashes] | None = None
    #: Decode workers that died under this request (never placed on again).
    dead_worker_ids: list[str] = field(default_factory=list)


class Placer:
    """Places requests; one instance per process, shared by all requests."""

    def __init__(
        self,
        router: Router,
        *,
        metrics: GatewayMetrics,
        router_unavailable_wait_s: float,
        cleanup_timeout_s: float,
        prompt_hasher: PromptHasher | None,
        run_in_background: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self._router = router
        self._metrics = metrics
        self._router_unavailable_wait_s = router_unavailable_wait_s
        self._cleanup_timeout_s = cleanup_timeout_s
        #: The prompt's prefix hashes for Schedule (None: none sent, the router places as if all were cold).
        self._prompt_hasher = prompt_hasher
        self._run_in_background = run_in_background
        #: Set at shutdown: background Release retries give up (their leases free the budget).
        self.closing = False

    async def place(
        self,
        job: GenerationJob,
        exclude_worker_ids: list[str],
        progress: Placing,
        *,
        prefill_done_on_worker_id: str = "",
        local_prefill_only: bool = False,
    ) -> router_pb2.Placement:
        """``Schedule`` on the router, asked again while the router is unreachable (a replica or the
        whole router restarting) for up to ``router_unavailable_wait_s``: the request waits (a stream
        sends its heartbeats) rather than failing at once, and fails with the router's
        error when the wait is over. Schedule is idempotent per request id (a second one replaces the
        first one's reservation). ``prefill_done_on_worker_id``, ``local_prefill_only``: a decode-only
        Schedule (see :meth:`replace_decode_worker`)."""
        if progress.prompt_block_hashes is None:
            progress.prompt_block_hashes = (
                await self._prompt_hasher.hashes(
                    job.model,
                    job.prompt_token_ids,
                    job.cache_salt,
                    adapter=job.adapter,
                    adapter_path=job.adapter_path,
                )
                if self._prompt_hasher is not None
                else []
            )
        delays = backoff_delays(within_s=self._router_unavailable_wait_s)
        while True:
            try:
                return await self._schedule_once(
                    job,
                    exclude_worker_ids,
                    progress.prompt_block_hashes,
                    prefill_done_on_worker_id=prefill_done_on_worker_id,
                    local_prefill_only=local_prefill_only,
                )
            except BackendUnavailableError:
                delay_s = next(delays, None)
                if delay_s is None:
                    raise
                self._metrics.router_unavailable_retries_total.inc()
                await asyncio.sleep(delay_s)

    async def _schedule_once(
        self,
        job: GenerationJob,
        exclude_worker_ids: list[str],
        hashes: list[router_pb2.PromptBlockHashes],
        *,
        prefill_done_on_worker_id: str = "",
        local_prefill_only: bool = False,
    ) -> router_pb2.Placement:
        """One ``Schedule``. If the request is cancelled meanwhile (the client left), the call
        is not cancelled with it: the router may already have reserved a pair, so the call runs to its
        end in the background and the reservation it made is ended, rather than held until its lease ends."""
        schedule = asyncio.ensure_future(
            self._router.schedule(
                request_id=job.request_id,
                model=job.model,
                num_prompt_tokens=len(job.prompt_token_ids),
                prompt_block_hashes=hashes,
                max_tokens=job.max_tokens,
                tenant=job.tenant,
                exclude_worker_ids=list(exclude_worker_ids),
                priority=job.priority,
                prefill_done_on_worker_id=prefill_done_on_worker_id,
                local_prefill_only=local_prefill_only,
                adapter=job.adapter,
            )
        )
        try:
            return await asyncio.shield(schedule)
        except asyncio.CancelledError:
            self._run_in_background(self._end_reservation_once_placed(job.request_id, schedule))
            raise

    async def _end_reservation_once_placed(
        self, request_id: str, schedule: asyncio.Future[router_pb2.Placement]
    ) -> None:
        try:
            await schedule
        except Exception:  # it failed: nothing was reserved
            return
        await self.end_reservation(request_id, retry_for_s=END_RESERVATION_RETRY_S)

    async def replace_decode_worker(self, job: GenerationJob, progress: Placing) -> None:
        """Ask the router for another decode worker, keeping the prefill worker that holds the KV.

        A disaggregated placement is placed again decode-only (``prefill_done_on_worker_id`` names the
        prefill worker), a local prefill as a local prefill again (``local_prefill_only``: nothing was
        streamed, the new decode worker prefills the prompt): either way the router reserves decode
        budget alone, none on a prefill worker that would do nothing. Nothing is ended first: a
        second Schedule of one request id replaces its earlier reservation in the router in one step
        (the dead pair's reservation ended, the new one made). Meanwhile ``progress.placement`` stays
        the previous one, so that if this Schedule fails (or the client leaves) cleanup still ends
        the reservation and aborts the prefill worker's held KV rather than leaving it to its lease.
        """
        assert progress.placement is not None
        previous = progress.placement
        dead = previous.decode
        progress.dead_worker_ids.append(dead.worker_id)
        prefill_done_on = "" if previous.local_prefill else previous.prefill.worker_id
        logger.warning(
            "decode worker unavailable before its first token; placing the decode once more",
            extra={
                "request_id": job.request_id,
                "worker_id": dead.worker_id,
                "prefill_worker_id": prefill_done_on,
                "local_prefill": previous.local_prefill,
            },
        )
        self._metrics.worker_retries_total.labels(role="decode").inc()
        placement = await self.place(
            job,
            list(progress.dead_worker_ids),
            progress,
            prefill_done_on_worker_id=prefill_done_on,
            local_prefill_only=previous.local_prefill,
        )
        # The KV stays where it was computed, and a local prefill stays local, even should a router of
        # an older version name another prefill worker.
        replaced = router_pb2.Placement()
        replaced.CopyFrom(placement)
        replaced.local_prefill = previous.local_prefill
        if previous.local_prefill:
            replaced.ClearField("prefill")
        else:
            replaced.prefill.CopyFrom(previous.prefill)
        progress.placement = replaced

    async def migrate_decode(self, job: GenerationJob, progress: Placing, *, reason: str, num_sent: int) -> None:
        """Place a stream whose decode worker died mid-stream again, decode-only and without every
        worker that died under it: the new decode worker computes the prompt (from its prefix cache
        where it has it: the router places by cache locality) and replays the tokens sent so far."""
        assert progress.placement is not None
        previous = progress.placement
        progress.dead_worker_ids.append(previous.decode.worker_id)
        logger.warning(
            "decode worker failed mid-stream; migrating the stream",
            extra={
                "request_id": job.request_id,
                "worker_id": previous.decode.worker_id,
                "reason": reason,
                "num_tokens_sent": num_sent,
            },
        )
        self._metrics.migrations_total.labels(role="decode", reason=reason).inc()
        placement = await self.place(job, list(progress.dead_worker_ids), progress, local_prefill_only=True)
        migrated = router_pb2.Placement()
        migrated.CopyFrom(placement)
        migrated.local_prefill = True
        migrated.ClearField("prefill")
        progress.placement = migrated

    async def end_reservation(self, request_id: str, *, retry_for_s: float = 0.0) -> None:
        """End the request's budget reservation in the router (``Release``); idempotent, so a background
        caller retries it for ``retry_for_s`` (a busy or restarting router) rather than leaving the budget
        held until the lease ends."""
        delays = backoff_delays(within_s=retry_for_s)
        while True:
            try:
                await asyncio.wait_for(self._router.release(request_id), self._cleanup_timeout_s)
                return
            except (TandemError, TimeoutError) as exc:
                delay_s = next(delays, None)
                if self.closing or delay_s is None:
                    # The reservation is a lease in the router: it expires by itself.
                    logger.warning(
                        "ending the router reservation failed: %s",
                        exc or type(exc).__name__,
                        extra={"request_id": request_id},
                    )
                    return
            await asyncio.sleep(delay_s)
