"""Redis for tests: a private server, clean-up of one test's keys, and per-component ACL users."""

from __future__ import annotations

import contextlib
import secrets
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit


def start_redis(port: int, *args: str) -> subprocess.Popen[bytes]:
    """A private redis-server on 127.0.0.1:``port`` (``args``: more of its options), once it accepts connections."""
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("redis-server did not start")


async def delete_prefix(client: Any, prefix: str) -> None:
    async for key in client.scan_iter(match=f"{prefix}:*", count=500):
        await client.delete(key)


@dataclass(frozen=True)
class AclUsers:
    """One test's Redis ACL users (tandem.common.redis_acl), one per component, and their URLs."""

    key_prefix: str
    urls: dict[str, str]

    def url(self, component: str) -> str:
        return self.urls[component]


@contextlib.asynccontextmanager
async def acl_users(redis_url: str = "redis://127.0.0.1:6379/0", *, label: str = "acltest") -> AsyncIterator[AclUsers]:
    """Every component's ACL user under a fresh test prefix (``<label>-<hex>``), created with the
    default (admin) connection at ``redis_url``; the users and the prefix's keys are deleted after."""
    import redis.asyncio as aioredis

    from tandem.common import redis_acl

    prefix = f"{label}-{uuid.uuid4().hex[:8]}"
    admin: Any = aioredis.Redis.from_url(redis_url)  # Any: execute_command is untyped
    parts = urlsplit(redis_url)
    urls = {}
    try:
        for component in redis_acl.COMPONENTS:
            password = secrets.token_urlsafe(16)
            await admin.execute_command("ACL", "SETUSER", *redis_acl.setuser_args(component, prefix, password))
            user = redis_acl.username(component, prefix)
            urls[component] = urlunsplit((parts.scheme, f"{user}:{password}@{parts.netloc}", parts.path, "", ""))
        yield AclUsers(prefix, urls)
    finally:
        for component in redis_acl.COMPONENTS:
            await admin.execute_command("ACL", "DELUSER", redis_acl.username(component, prefix))
        await delete_prefix(admin, prefix)
        await admin.aclose()


async def acl_denials(client: Any, key_prefix: str) -> list[dict[str, Any]]:
    """Entries of Redis's ACL LOG (commands and keys refused) for the users of ``key_prefix``."""
    entries = await client.execute_command("ACL", "LOG")
    out = []
    for entry in entries:
        fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2], strict=True))
        fields = {_text(k): _text(v) for k, v in fields.items()}
        if str(fields.get("username", "")).startswith(f"{key_prefix}-"):
            out.append(fields)
    return out


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value
