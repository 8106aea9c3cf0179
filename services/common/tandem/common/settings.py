"""Settings groups shared by several services. Each service reads its own
settings class once at its entry point (environment variables with the
``TANDEM_`` prefix, nested with ``__``) and passes the groups down."""

from __future__ import annotations

from pydantic import BaseModel, Field


class RedisSettings(BaseModel):
    """Where the registry, tenants and quotas live."""

    #: Redis URL shared by all services.
    url: str = "redis://127.0.0.1:6379/0"


class RegistrySettings(BaseModel):
    """Worker registration."""

    #: Key prefix in Redis, so that several stacks can share one Redis.
    key_prefix: str = "tandem"
    #: How often a worker refreshes its registration.
    heartbeat_interval_s: float = Field(1.0, gt=0)
    #: How long a registration outlives its last heartbeat.
    ttl_s: float = Field(5.0, gt=0)
