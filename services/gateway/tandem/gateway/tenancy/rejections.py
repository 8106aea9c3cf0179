"""Requests the gateway refuses count against their key: past ``limit_per_minute``
refusals in a minute, the key's next requests get 429 before their body is read.

Why: refusing a request can cost more gateway CPU than serving it starts with
(a 256 KiB message over the context is read, rendered and tokenized before it
is found too long: 0.2-0.3 s of a core), and refusals are never charged to
any quota. A few loops from one key kept a gateway core busy. Now a key that
keeps sending what is refused is itself refused cheaply, by the gateway's
first check after authentication.

Counted (:func:`counts_against_key`): what the request preparation refuses after
authentication because the request itself is wrong, so that sending it again
cannot help (:func:`tandem.gateway.api.prepare.prepare`): a malformed or
out-of-bounds body (400), one too large (413, the body or its text; also the
tenant's storage quota, refused after the prompt was assembled, the costliest
refusal there is), a model or action the key's tenant may not use (403). Not
counted, because they are not the client's mistake or may succeed as they are
a moment later: 404 ``model_not_found`` (a client polling for an adapter that
an operator is rolling out is doing the normal thing, and a 404 is refused
before the prompt is rendered or tokenized, the costly part), 429 and 503
(the quota, the concurrency cap, a draining replica, a backend down: retryable
by definition), 401 (no key to count against).

Shared by every gateway replica through Redis: one ``HINCRBY`` per refusal on
``<prefix>:gw:quota:<tenant>:rejected:<minute>`` (a field per key id; the hash
lives two minutes), so the happy path costs nothing. Each replica remembers
locally which keys are over the limit until the minute ends; another replica
learns it at its own next refusal of that key, so a key gets at most
``limit_per_minute`` plus one refusal per replica each minute. Redis down: the
refusal is not counted (the request was refused anyway).
"""

from __future__ import annotations

import logging
import math
import time

import redis.asyncio as aioredis

from tandem.common.errors import BackendUnavailableError, InvalidRequestError, PermanentError, TandemError
from tandem.gateway.errors import RateLimitedError
from tandem.gateway.redis_client import redis_errors
from tandem.gateway.tenancy.auth import Principal

logger = logging.getLogger(__name__)

_WINDOW_S = 60
#: Refusals that are not the client's mistake: the model or adapter may exist a moment later.
_NOT_COUNTED_CODES = frozenset({"model_not_found"})


def counts_against_key(exc: TandemError) -> bool:
    """Whether refusing a request with ``exc`` counts against its key (see the module's docstring)."""
    if not isinstance(exc, PermanentError):
        return False  # retryable: 429, 503
    return not (isinstance(exc, InvalidRequestError) and exc.code in _NOT_COUNTED_CODES)


class RejectionLimiter:
    def __init__(self, client: aioredis.Redis, *, key_prefix: str, limit_per_minute: int) -> None:
        self._redis = client
        self._p = f"{key_prefix}:gw:quota"
        self._limit = limit_per_minute
        #: key id → the end (Unix seconds) of the minute in which it went over the limit.
        self._blocked_until_s: dict[str, float] = {}

    def check(self, principal: Principal) -> None:
        """RateLimitedError (429) while ``principal``'s key is over its refusals this minute."""
        if not principal.key_id or self._limit <= 0:
            return
        until_s = self._blocked_until_s.get(principal.key_id)
        if until_s is None:
            return
        now_s = time.time()
        if now_s >= until_s:
            del self._blocked_until_s[principal.key_id]
            return
        retry_after_s = max(1, math.ceil(until_s - now_s))
        raise RateLimitedError(
            f"Too many invalid requests from this API key: more than {self._limit} in a minute. "
            f"Please fix the requests and try again in {retry_after_s}s.",
            kind="requests",
            retry_after_s=retry_after_s,
            headers={},
        )

    async def count(self, principal: Principal) -> None:
        """One more refused request of ``principal``'s key (never raises)."""
        if not principal.key_id or self._limit <= 0:
            return
        now_s = time.time()
        minute = int(now_s // _WINDOW_S)
        key = f"{self._p}:{principal.tenant.id}:rejected:{minute}"
        try:
            with redis_errors("rejected requests"):
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.hincrby(key, principal.key_id, 1)
                    pipe.expire(key, 2 * _WINDOW_S)
                    num_rejected, _ = await pipe.execute()
        except BackendUnavailableError as exc:
            logger.warning("refused request not counted: %s", exc, extra={"tenant": principal.tenant.id})
            return
        if int(num_rejected) >= self._limit:
            self._blocked_until_s[principal.key_id] = (minute + 1) * _WINDOW_S
            if len(self._blocked_until_s) > 100_000:  # keys of ended minutes, left by keys never seen again
                self._blocked_until_s = {k: v for k, v in self._blocked_until_s.items() if v > now_s}
