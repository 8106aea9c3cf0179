"""Per-tenant token quotas and concurrency caps, shared by all gateway replicas
through Redis. :class:`~.base.Quota` is the seam; :class:`~.redis_quota.RedisQuota`
the implementation (two token buckets and a lease set, in Lua scripts)."""
