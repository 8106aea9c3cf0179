"""One request's path through the disaggregated back end.

Called by the route handlers (through :meth:`Orchestrator.generate`); calls the
router through a :class:`~tandem.gateway.placement.Placer` (each placement, and
each placement again when a worker died) and the workers through
:class:`~tandem.gateway.workers.WorkerChannels`:

1. ``Schedule`` → a (prefill, decode) placement, or a decode worker alone
   (``local_prefill``: little of the prompt is uncached there, so it prefills
   the prompt itself and there is no handoff);
2. ``Prefill`` on the prefill worker → the first token (retried once on another
   prefill worker when the first one is UNAVAILABLE); skipped for a local prefill.
   At the same moment, in the background, ``PrefetchKV`` on the decode worker: it
   starts pulling the prompt's KV from the prefill worker while the prefill still
   runs, so that the Decode below finds it local (best effort: without it, or if
   the decode worker refuses, Decode pulls after the prefill as before);
3. ``Decode`` stream on the decode worker → the remaining tokens (all of them
   for a local prefill), unless the first token already finished the request
   (placed once more on another decode worker when the first one is
   UNAVAILABLE before it sent anything: a decode-only ``Schedule`` that keeps
   the prefill worker holding the KV). A decode worker that dies mid-stream
   (UNAVAILABLE: its process or its engine died) is *migrated*: a decode-only
   ``Schedule`` without the dead worker, and a ``Decode`` that computes the
   prompt and resumes after the tokens the client has received (the worker
   replays them: tandem.worker.first_token), so the client sees one stream,
   no token twice and none missing; at most ``max_migrations`` times a request;
4. always: ``Release`` on the router, and ``Abort`` on both workers when the
   generation did not complete (error, timeout, client gone), so that held KV
   blocks are freed at once rather than when their lease runs out.

A request with a LoRA adapter carries its engine name (``job.adapter``) in every Schedule, Prefill,
PrefetchKV and Decode above, retries, replacements and migrations included: all of them are built from
the job.
A worker's refusal of the adapter is mapped by :func:`~tandem.gateway.workers.map_worker_error`.

Events are yielded as small frozen dataclasses; the HTTP layer turns them into
SSE chunks or one JSON body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.common.errors import PermanentError, TandemError, WorkerUnavailableError
from tandem.gateway.job import Finished, GenerationEvent, GenerationJob, TextDelta, Usage
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.placement import END_RESERVATION_RETRY_S, Placer, Placing
from tandem.gateway.prefix_hashes import PromptHasher
from tandem.gateway.router import Router
from tandem.gateway.timings import StageClock
from tandem.gateway.workers import WorkerChannels, map_worker_error
from tandem.v1 import router_pb2, worker_pb2

logger = logging.getLogger(__name__)


class _Truncated(Exception):
    """A decode stream that ended without a finish reason and without an error."""


def _decode_failure(exc: grpc.aio.AioRpcError | _Truncated, address: str, adapter: str) -> TandemError:
    if isinstance(exc, _Truncated):
        return WorkerUnavailableError(str(exc))
    return map_worker_error(exc, role="decode", address=address, adapter=adapter)


@dataclass
class _Progress(Placing):
    """What cleanup needs to know about how far a request got (where it is placed: :class:`Placing`)."""

    completed: bool = False
    decode_call: grpc.aio.UnaryStreamCall | None = None  # type: ignore[type-arg]


@dataclass
class _Sent:
    """What the client has received of the answer: a migrated stream resumes after it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""


async def _logged(work: Coroutine[Any, Any, None]) -> None:
    try:
        await work
    except Exception:
        logger.exception("background work failed")


def _record_decode_stats(clock: StageClock, stats: worker_pb2.DecodeStats) -> None:
    if stats.kv_transfer_seconds:
        clock.worker["kv_transfer_s"] = stats.kv_transfer_seconds
    if stats.kv_transfer_bytes:
        clock.worker["kv_transfer_bytes"] = stats.kv_transfer_bytes
    if stats.kv_prefetched:
        clock.worker["kv_prefetched"] = 1
    if stats.kv_reported_after_seconds:
        clock.worker["kv_reported_after_s"] = stats.kv_reported_after_seconds
    if stats.kv_prefetch_wait_seconds:
        clock.worker["kv_prefetch_wait_s"] = stats.kv_prefetch_wait_seconds
    if stats.first_token_seconds:
        clock.worker["decode_first_token_s"] = stats.first_token_seconds
    if stats.num_kv_tokens_loaded:
        clock.worker["num_kv_tokens_loaded"] = stats.num_kv_tokens_loaded
    if stats.num_decode_cached_tokens:
        # The decode worker's prefix hit, beside the router's expectation of it
        # (num_router_expected_decode_cached_tokens), as num_cached_tokens is the prefill worker's.
        clock.worker["num_decode_cached_tokens"] = stats.num_decode_cached_tokens
    if stats.engine_first_token_after_seconds:
        clock.worker["decode_engine_queued_after_s"] = stats.engine_queued_after_seconds
        clock.worker["decode_engine_scheduled_after_s"] = stats.engine_scheduled_after_seconds
        clock.worker["decode_engine_first_token_after_s"] = stats.engine_first_token_after_seconds


class Orchestrator:
    """Runs requests; one instance per process, shared by all requests."""

    def __init__(
        self,
        router: Router,
        workers: WorkerChannels,
        *,
        metrics: GatewayMetrics,
        prefill_timeout_s: float,
        request_timeout_s: float,
        cleanup_timeout_s: float,
        router_unavailable_wait_s: float = 0.0,
        prompt_hasher: PromptHasher | None = None,
        kv_prefetch: bool = False,
        max_migrations: int = 3,
    ) -> None:
        #: A stream's decode worker may die this many times before the client gets the error (0: never
        #: migrate; the stream ends with an error event, as before migration existed).
        self._max_migrations = max_migrations
        #: Ask the decode worker to prefetch the prompt's KV while the prefill runs.
        self._kv_prefetch = kv_prefetch
        self._workers = workers
        self._metrics = metrics
        self._prefill_timeout_s = prefill_timeout_s
        self._request_timeout_s = request_timeout_s
        self._cleanup_timeout_s = cleanup_timeout_s
        self._cleanup_tasks: set[asyncio.Task[None]] = set()
        self._placer = Placer(
            router,
            metrics=metrics,
            router_unavailable_wait_s=router_unavailable_wait_s,
            cleanup_timeout_s=cleanup_timeout_s,
            prompt_hasher=prompt_hasher,
            run_in_background=self.run_in_background,
        )

    async def generate(self, job: GenerationJob) -> AsyncGenerator[GenerationEvent, None]:
        """Yield the first token's delta, further deltas, then one :class:`Finished`.

        Raises TandemError subclasses. The caller must close the iterator
        (``contextlib.aclosing``) or cancel the task consuming it; either way
        the in-flight gRPC call is cancelled and cleanup is started.
        """
        deadline = time.monotonic() + self._request_timeout_s
        progress = _Progress()
        try:
            prefill = await self._schedule_and_prefill(job, progress, deadline)
            if prefill is not None:
                first_logprobs = (prefill.first_logprobs,) if prefill.HasField("first_logprobs") else ()
                yield TextDelta(prefill.first_text, 1, first_logprobs)
                if prefill.finish_reason or job.max_tokens <= 1:
                    progress.completed = True
                    # No decode follows: a prefetch the decode worker staged for it would wait out its
                    # keep time (the fault suite's fuzz found ~17 MB staged after its answers).
                    self._drop_prefetch(job, progress.placement)
                    usage = Usage(len(job.prompt_token_ids), 1, prefill.num_cached_tokens)
                    yield Finished(prefill.finish_reason or "length", usage, prefill.stop_string)
                    return
            assert progress.placement is not None
            num_cached_tokens = 0 if prefill is None else prefill.num_cached_tokens
            finish_reason = ""
            stop_string = ""
            sent = _Sent() if prefill is None else _Sent([prefill.first_token_id], prefill.first_text)
            resume: _Sent | None = None  # set once the stream migrated
            migrated_at_s: float | None = None
            num_migrations = 0
            while not finish_reason:
                call = self._start_decode(job, progress.placement, None if resume else prefill, deadline, resume)
                progress.decode_call = call
                num_chunks = 0
                try:
                    async for chunk in call:
                        num_chunks += 1
                        if chunk.HasField("stats"):
                            _record_decode_stats(job.clock, chunk.stats)
                            if prefill is None:
                                num_cached_tokens = chunk.stats.num_decode_cached_tokens
                        if prefill is None and chunk.token_ids:
                            job.clock.mark("prefill_done")  # the decode worker's own prefill
                        if migrated_at_s is not None and chunk.token_ids:
                            job.clock.worker["migration_s"] = (
                                job.clock.worker.get("migration_s", 0.0) + time.monotonic() - migrated_at_s
                            )
                            migrated_at_s = None
                        sent.token_ids.extend(chunk.token_ids)
                        sent.text += chunk.text
                        if chunk.text or chunk.token_ids:
                            # Empty text (a token that completes no character yet) still counts as a token.
                            yield TextDelta(chunk.text, len(chunk.token_ids), tuple(chunk.logprobs))
                        if chunk.finish_reason:
                            finish_reason = chunk.finish_reason
                            stop_string = chunk.stop_string
                    if not finish_reason:
                        # Closed with OK but unfinished (a proxy cut it, a worker bug): as good as dead.
                        raise _Truncated(f"decode worker {progress.placement.decode.address}: stream ended early")
                except (grpc.aio.AioRpcError, _Truncated) as exc:
                    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise map_worker_error(
                            exc, role="decode", address=progress.placement.decode.address, adapter=job.adapter
                        ) from exc
                    if num_chunks == 0 and resume is None and not progress.dead_worker_ids:
                        # The decode worker was gone before it sent anything (it died between requests and
                        # its registration has not expired yet): the prefill worker still holds the KV under
                        # its lease, so another decode worker can take over without the client noticing.
                        await self._placer.replace_decode_worker(job, progress)
                        continue
                    if len(sent.token_ids) >= job.max_tokens:
                        finish_reason = "length"  # it died after the last token, before saying it was the last
                        break
                    if num_migrations >= self._max_migrations:
                        raise _decode_failure(exc, progress.placement.decode.address, job.adapter) from exc
                    num_migrations += 1
                    job.clock.worker["num_migrations"] = num_migrations
                    job.clock.worker["num_resumed_tokens"] = len(sent.token_ids)
                    migrated_at_s = time.monotonic()
                    reason = "truncated" if isinstance(exc, _Truncated) else exc.code().name.lower()
                    if progress.placement.prefill.address:  # its hold, if any is left, is of no use now
                        self.run_in_background(self._abort(progress.placement.prefill.address, job.request_id))
                    await self._placer.migrate_decode(job, progress, reason=reason, num_sent=len(sent.token_ids))
                    resume = sent
            progress.completed = True
            # Every token the client received, once: a resumed worker streams none of those it was given.
            usage = Usage(len(job.prompt_token_ids), len(sent.token_ids), num_cached_tokens)
            yield Finished(finish_reason, usage, stop_string)
        finally:
            if progress.decode_call is not None and not progress.decode_call.done():
                progress.decode_call.cancel()
            if progress.placement is not None:
                self._start_cleanup(job.request_id, progress.placement, aborted=not progress.completed)

    async def _schedule_and_prefill(
        self, job: GenerationJob, progress: _Progress, deadline: float
    ) -> worker_pb2.PrefillResponse | None:
        """The prefill worker's answer, or None when the router placed a local prefill."""
        excluded: list[str] = []
        for attempt in range(2):
            placement = await self._placer.place(job, excluded, progress)
            progress.placement = placement
            job.clock.remark("scheduled")
            job.clock.worker["num_router_expected_decode_cached_tokens"] = placement.num_decode_cached_tokens
            if placement.local_prefill:
                job.clock.worker["local_prefill"] = 1
                return None
            request = worker_pb2.PrefillRequest(
                request_id=job.request_id,
                prompt_token_ids=job.prompt_token_ids,
                sampling=job.sampling.to_proto(job.max_tokens),
                cache_salt=job.cache_salt,
                keep_kv=job.max_tokens > 1,
                adapter=job.adapter,
            )
            if request.keep_kv:
                request.kv_capability = job.kv_capability
            if request.keep_kv:
                self._start_prefetch(job, placement)
            stub = self._workers.stub(placement.prefill.address)
            timeout_s = max(0.001, min(self._prefill_timeout_s, deadline - time.monotonic()))
            try:
                response: worker_pb2.PrefillResponse = await stub.Prefill(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt == 0:
                    logger.warning(
                        "prefill worker unavailable; rescheduling once",
                        extra={"request_id": job.request_id, "worker_id": placement.prefill.worker_id},
                    )
                    self._metrics.worker_retries_total.labels(role="prefill").inc()
                    self._metrics.migrations_total.labels(role="prefill", reason="unavailable").inc()
                    progress.placement = None
                    self._drop_prefetch(job, placement)  # the next placement may name another decode worker
                    await self._placer.end_reservation(job.request_id)
                    excluded.append(placement.prefill.worker_id)
                    continue
                raise map_worker_error(
                    exc, role="prefill", address=placement.prefill.address, adapter=job.adapter
                ) from exc
            job.clock.mark("prefill_done")
            job.clock.worker["prefill_engine_s"] = response.engine_seconds
            job.clock.worker["num_cached_tokens"] = response.num_cached_tokens
            job.clock.worker["num_router_expected_cached_tokens"] = placement.num_cached_tokens
            return response
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_prefetch(self, job: GenerationJob, placement: router_pb2.Placement) -> None:
        """``PrefetchKV`` on the decode worker, in the background: the Prefill is not held up by it,
        and its answer (or failure) changes nothing but where the Decode finds the KV."""
        if not self._kv_prefetch or not placement.prefill.kv_address or not placement.decode.address:
            return
        request = worker_pb2.PrefetchKVRequest(
            request_id=job.request_id,
            kv_address=placement.prefill.kv_address,
            num_prompt_tokens=len(job.prompt_token_ids),
            num_decode_cached_tokens=placement.num_decode_cached_tokens,
            kv_capability=job.kv_capability,
            adapter=job.adapter,
        )
        self.run_in_background(self._prefetch(placement.decode.address, request))

    def _drop_prefetch(self, job: GenerationJob, placement: router_pb2.Placement | None) -> None:
        """Tell the decode worker that no decode comes for ``job`` (its Abort drops a staged prefetch)."""
        if self._kv_prefetch and placement is not None and placement.decode.address and job.max_tokens > 1:
            self.run_in_background(self._abort(placement.decode.address, job.request_id))

    async def _prefetch(self, address: str, request: worker_pb2.PrefetchKVRequest) -> None:
        try:
            response = await self._workers.stub(address).PrefetchKV(request, timeout=self._cleanup_timeout_s)
        except grpc.aio.AioRpcError as exc:
            outcome = "failed"
            logger.info("KV prefetch on %s: %s", address, exc.code().name, extra={"request_id": request.request_id})
        else:
            outcome = "started" if response.accepted else "refused"
            if not response.accepted:
                logger.info("KV prefetch refused: %s", response.reason, extra={"request_id": request.request_id})
        self._metrics.kv_prefetches_total.labels(outcome=outcome).inc()

    def _start_decode(
        self,
        job: GenerationJob,
        placement: router_pb2.Placement,
        prefill: worker_pb2.PrefillResponse | None,
        deadline: float,
        resume: _Sent | None = None,
    ) -> grpc.aio.UnaryStreamCall:  # type: ignore[type-arg]
        """``Decode`` after ``prefill``'s first token; for a local prefill (``prefill`` None) from the
        prompt, resuming after ``resume`` (a migrated stream) when given."""
        request = worker_pb2.DecodeRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            sampling=job.sampling.to_proto(job.max_tokens),
            cache_salt=job.cache_salt,
            adapter=job.adapter,
        )
        if prefill is None:
            request.local_prefill = True
            if resume is not None:
                request.resume_token_ids.extend(resume.token_ids)
                request.resume_text = resume.text
        elif not prefill.HasField("kv_handle"):
            raise PermanentError("prefill worker kept no KV for the decode worker")
        else:
            request.first_token_id = prefill.first_token_id
            request.first_text = prefill.first_text
            request.kv_handle.CopyFrom(prefill.kv_handle)
            request.kv_capability = job.kv_capability
        stub = self._workers.stub(placement.decode.address)
        call: grpc.aio.UnaryStreamCall = stub.Decode(  # type: ignore[type-arg]
            request, timeout=max(0.001, deadline - time.monotonic())
        )
        return call

    def _start_cleanup(self, request_id: str, placement: router_pb2.Placement, *, aborted: bool) -> None:
        # A task of its own: cleanup must finish even though the caller's task is being cancelled,
        # and the client's [DONE] should not wait for the router's Release round trip.
        task = asyncio.get_running_loop().create_task(self._cleanup(request_id, placement, aborted=aborted))
        self._cleanup_tasks.add(task)
        task.add_done_callback(self._cleanup_tasks.discard)

    async def _cleanup(self, request_id: str, placement: router_pb2.Placement, *, aborted: bool) -> None:
        calls = [self._placer.end_reservation(request_id, retry_for_s=END_RESERVATION_RETRY_S)]
        if aborted:
            addresses = {placement.prefill.address, placement.decode.address} - {""}
            calls += [self._abort(address, request_id) for address in sorted(addresses)]
        await asyncio.gather(*calls)

    async def _abort(self, address: str, request_id: str) -> None:
        try:
            await self._workers.stub(address).Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=self._cleanup_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            # Held KV blocks are leased by the prefill worker: they are freed when the lease runs out.
            logger.warning("abort on %s failed: %s", address, exc.code().name, extra={"request_id": request_id})

    def run_in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` to its end even if the request's task is cancelled; awaited by :meth:`drain`."""
        task = asyncio.get_running_loop().create_task(_logged(work))
        self._cleanup_tasks.add(task)
        task.add_done_callback(self._cleanup_tasks.discard)

    async def drain(self) -> None:
        """Wait for cleanup started so far (at shutdown)."""
        self._placer.closing = True
        if self._cleanup_tasks:
            await asyncio.gather(*list(self._cleanup_tasks), return_exceptions=True)
