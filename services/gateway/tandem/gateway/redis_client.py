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
from tandem.common.redis_retry import retry_on_broken_connection


def connect(url: str, *, timeout_s: float) -> aioredis.Redis:
    """A pooled client; a command that meets a connection a Redis restart left dead is sent once
    more on a fresh one (:mod:`tandem.common.redis_retry`)."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=0,
        retry_on_timeout=False,
        retry=retry_on_broken_connection(),
    )


@contextlib.contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Redis unreachable or failing → BackendUnavailableError (the boundary of the Redis library)."""
    try:
        yield
    except ResponseError:
        raise  # a bug of ours (bad script, wrong type), not an outage
    except (RedisError, OSError) as exc:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise BackendUnavailableError(f"redis unavailable during {what}: {detail}") from exc
