"""A non-streamed answer: one JSON body once generation has finished.

Returned by the route handlers for ``stream: false`` (see
:mod:`tandem.gateway.api.generation` for what all answers share). An error at
any point is an OpenAI error body with its HTTP status: nothing was sent yet.
"""

from __future__ import annotations

import json
import logging

from starlette.types import Send

from tandem.common.errors import TandemError
from tandem.gateway.api.errors import api_error_from, internal_error
from tandem.gateway.api.generation import EventSource, GenerationResponse, raw_headers, send_body, send_error
from tandem.gateway.job import Finished, TextDelta

logger = logging.getLogger(__name__)


class CompleteResponse(GenerationResponse):
    async def _respond(self, send: Send, source: EventSource) -> int:
        try:
            await self._first_event(source)
            await self._save_progress()
            async for event in source.remaining():
                if isinstance(event, TextDelta):
                    self._record(event)
                    await self._save_progress()
                elif isinstance(event, Finished):
                    self._finished = event
        except TandemError as exc:
            return await send_error(send, api_error_from(exc, request_id=self._job.request_id), self._options.wire)
        except Exception:
            logger.exception("generation failed", extra={"request_id": self._job.request_id})
            return await send_error(send, internal_error(), self._options.wire)
        finished = self._finished
        if finished is None:
            return await send_error(send, internal_error(), self._options.wire)
        self._metrics.count_generated(finished.usage.completion_tokens, model=self._job.model)
        self._job.clock.mark("first_byte")
        self._job.clock.mark("done")
        await self._answer_complete(finished)
        payload = self._options.wire.full_response(self._meta, "".join(self._texts), finished, self._logprobs)
        payload.update(self._options.extra_fields)
        if self._options.timings:
            payload["tandem_timings"] = self._job.clock.breakdown()
        body = json.dumps(payload, ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json", **self._options.headers, "X-Request-Id": self._job.request_id}
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers(headers, length=len(body))})
        await send_body(send, body, more_body=False)
        return 200
