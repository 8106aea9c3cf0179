"""The gateway's Redis connection and the mapping of Redis failures.

Built once by :func:`tandem.gateway.app.build_app` (or the admin CLI) and
shared by the tenant store, the quota, usage and conversations. Short socket
timeouts on purpose: a Redis that hangs must turn into a quick 503, not a
request that waits for the kernel. redis-py reconnects on the next command, so
the gateway recovers by itself when Redis is back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError, ResponseError

from tandem.common import redis_retry
from tandem.common.errors import BackendUnavailableError


def connect(url: str, *, timeout_s: float) -> aioredis.Redis:
    """The gateway's pooled client (:func:`tandem.common.redis_retry.connect`), answering str."""
    return redis_retry.connect(url, timeout_s=timeout_s, decode_responses=True)


#: Redis answers that mean "this Redis will not take writes now" (full at maxmemory with noeviction, a
#: read-only replica, a failed snapshot, still loading its data): an outage, not a bug of ours.
REFUSING_WRITES = ("OOM", "READONLY", "MISCONF", "LOADING", "BUSY", "MASTERDOWN", "NOREPLICAS")


@contextlib.contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Redis unreachable, failing or refusing writes → BackendUnavailableError (the boundary of the Redis
    library); any other error answer is a bug of ours (bad script, wrong type) and is raised as is."""
    try:
        yield
    except ResponseError as exc:
        message = str(exc)
        refusing = isinstance(exc, OutOfMemoryError | ReadOnlyError) or message.startswith(REFUSING_WRITES)
        if refusing or "command not allowed when used memory" in message:
            raise BackendUnavailableError(f"redis refuses writes during {what}: {message[:200]}") from exc
        raise
    except (RedisError, OSError) as exc:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise BackendUnavailableError(f"redis unavailable during {what}: {detail}") from exc
