"""The Redis client of every Tandem component (gateway, router, worker registry),
and its retry policy.

``redis.asyncio.Redis.from_url`` retries nothing by default. After a Redis
restart every idle pooled connection is dead, and each then failed one command
when it was next used: a 503 for a request at the gateway, a missed heartbeat
or a failed placement in the router. A command that meets a broken connection
is now sent once more, at once, on a fresh connection. Timeouts are not
retried: a hung Redis stays a quick, bounded failure.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


def retry_on_broken_connection() -> Retry:
    """One immediate retry on a fresh connection when the pooled one turns out to be dead."""
    return Retry(NoBackoff(), retries=1, supported_errors=(RedisConnectionError,))


def connect(url: str, *, timeout_s: float, decode_responses: bool = False) -> aioredis.Redis:
    """A pooled client with short socket timeouts and :func:`retry_on_broken_connection`."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=decode_responses,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=0,
        retry_on_timeout=False,
        retry=retry_on_broken_connection(),
    )
