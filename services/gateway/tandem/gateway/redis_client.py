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
from redis.exceptions import RedisError, ResponseError

from tandem.common.errors import BackendUnavailableError


def connect(url: str, *, timeout_s: float) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=0,
        retry_on_timeout=False,
    )


@contextlib.contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Redis unreachable or failing → BackendUnavailableError (the boundary of the Redis library)."""
    try:
        yield
    except ResponseError:
        raise  # a bug of ours (bad script, wrong type), not an outage
    except (RedisError, OSError) as exc:
        raise BackendUnavailableError(f"redis unavailable during {what}: {type(exc).__name__}") from exc
