"""Settings groups shared by several services. Each service reads its own
settings class once at its entry point (environment variables with the
``TANDEM_`` prefix, nested with ``__``) and passes the groups down."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel, Field


class RedisSettings(BaseModel):
    """Where the registry, tenants and quotas live, and as whom each component logs in.

    Each component has a Redis ACL user of its own (:mod:`tandem.common.redis_acl`). Its credentials
    go in the URL (``redis://user:password@host:6379/0``; ``rediss://`` for TLS, with
    ``?ssl_ca_certs=/path/ca.crt`` for a private CA), or, so that the password need not live in an
    environment variable, in ``username`` and ``password_file`` (a mounted Secret), which take
    precedence over the URL's. Services connect with :meth:`connection_url`."""

    #: Redis URL shared by all services.
    url: str = "redis://127.0.0.1:6379/0"
    #: ACL user to log in as ("": the URL's, else Redis's ``default``).
    username: str = ""
    #: File whose content (one line) is the user's password; read when the service starts.
    password_file: Path | None = None

    def address(self) -> str:
        """``url`` without its credentials, for messages and logs."""
        parts = urlsplit(self.url)
        netloc = parts.netloc.rpartition("@")[2]
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))

    def connection_url(self) -> str:
        """``url`` with ``username`` and the password from ``password_file`` in it (each only when set)."""
        if not self.username and self.password_file is None:
            return self.url
        parts = urlsplit(self.url)
        username = self.username or parts.username or ""
        password = parts.password
        if self.password_file is not None:
            password = self.password_file.read_text().rstrip("\r\n")
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 literal
            host = f"[{host}]"
        netloc = host + (f":{parts.port}" if parts.port is not None else "")
        if password is not None:
            netloc = f"{quote(username, safe='')}:{quote(password, safe='')}@{netloc}"
        elif username:
            netloc = f"{quote(username, safe='')}@{netloc}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class RegistrySettings(BaseModel):
    """Worker registration."""

    #: Key prefix in Redis, so that several stacks can share one Redis.
    key_prefix: str = "tandem"
    #: How often a worker refreshes its registration.
    heartbeat_interval_s: float = Field(1.0, gt=0)
    #: How long a registration outlives its last heartbeat.
    ttl_s: float = Field(5.0, gt=0)
