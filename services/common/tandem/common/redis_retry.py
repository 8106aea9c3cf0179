"""The retry policy of every Tandem Redis client (gateway, router, worker registry).

``redis.asyncio.Redis.from_url`` retries nothing by default. After a Redis
restart every idle pooled connection is dead, and each then failed one command
when it was next used: a 503 for a request at the gateway, a missed heartbeat
or a failed placement in the router. A command that meets a broken connection
is now sent once more, at once, on a fresh connection. Timeouts are not
retried: a hung Redis stays a quick, bounded failure.
"""

from __future__ import annotations

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


def retry_on_broken_connection() -> Retry:
    """One immediate retry on a fresh connection when the pooled one turns out to be dead."""
    return Retry(NoBackoff(), retries=1, supported_errors=(RedisConnectionError,))
