"""The local stack's Redis users: one per component, as in the chart (:mod:`tandem.common.redis_acl`).

Called by :class:`tandem.local.stack.LocalStack` when it starts (and after it restarted its own
Redis, which forgets its users); calls Redis with the stack's admin connection (``redis_url``:
locally Redis's ``default`` user). Each user is created from scratch with ``ACL SETUSER``, its name
carries the stack's key prefix (``tandem-gateway``), and its password is generated once and kept in
the cache folder (``~/.cache/tandem/redis-users/<user>.password``, mode 0600), so that a restarted
component, or the next ``make run``, logs in with the same one. Each process gets only its own
user's name and the path of its password file (``TANDEM_<SERVICE>_REDIS__USERNAME`` and
``__PASSWORD_FILE``): no password travels in an environment variable or a command line.

A Redis that is not ours to administer (``ACL SETUSER`` refused) stops the stack with
:class:`RedisUsersError`, which says what to do: give it an admin connection, or run every process
as ``redis_url``'s own user (``StackConfig(redis_users=False)``, ``make run
RUN_ARGS=--no-redis-users``), which is explicit, never a silent fallback.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import redis

from tandem.common import redis_acl
from tandem.common.settings import RedisSettings


def default_users_dir() -> Path:
    return Path.home() / ".cache" / "tandem" / "redis-users"


class RedisUsersError(RuntimeError):
    """The stack could not create its Redis users; the message says why and what to do."""


@dataclass(frozen=True)
class RedisLogin:
    """One component's Redis user and the file that holds its password."""

    username: str
    password_file: Path

    def env(self, prefix: str) -> dict[str, str]:
        """Environment for a component whose settings prefix is ``prefix`` (``TANDEM_GATEWAY_``)."""
        return {f"{prefix}REDIS__USERNAME": self.username, f"{prefix}REDIS__PASSWORD_FILE": str(self.password_file)}

    def url(self, redis_url: str) -> str:
        """``redis_url`` logged in as this user (for tools in this process)."""
        return RedisSettings(url=redis_url, username=self.username, password_file=self.password_file).connection_url()


def _password(path: Path) -> str:
    """The password kept at ``path``, made (mode 0600) the first time."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    password = secrets.token_urlsafe(32)
    # Created with 0600 from the start: the password is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


def ensure_users(admin_url: str, key_prefix: str, users_dir: Path) -> dict[str, RedisLogin]:
    """Create (or reset to the current rules) every component's user; their logins by component."""
    logins: dict[str, RedisLogin] = {}
    client = redis.Redis.from_url(admin_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        for component in redis_acl.COMPONENTS:
            name = redis_acl.username(component, key_prefix)
            path = users_dir / f"{name}.password"
            password = _password(path)
            try:
                client.execute_command("ACL", "SETUSER", *redis_acl.setuser_args(component, key_prefix, password))  # type: ignore[no-untyped-call]
            except redis.ResponseError as exc:
                raise RedisUsersError(
                    f"Redis at {_address(admin_url)} refused to create the user {name} ({exc}). The local stack "
                    "gives each component a Redis user of its own and needs a connection allowed ACL SETUSER "
                    "for that (redis_url); for a Redis that is not yours to administer, run every process as "
                    "redis_url's user instead: StackConfig(redis_users=False), or "
                    "`make run RUN_ARGS=--no-redis-users`"
                ) from exc
            logins[component] = RedisLogin(name, path)
    finally:
        client.close()
    return logins


def drop_users(admin_url: str, key_prefix: str, users_dir: Path) -> None:
    """Delete the users of ``key_prefix`` and their password files (a stack that keeps none)."""
    names = [redis_acl.username(component, key_prefix) for component in redis_acl.COMPONENTS]
    client = redis.Redis.from_url(admin_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        client.execute_command("ACL", "DELUSER", *names)  # type: ignore[no-untyped-call]
    except redis.ConnectionError:
        pass  # the stack's own Redis, stopped already: its users went with it
    finally:
        client.close()
    for name in names:
        (users_dir / f"{name}.password").unlink(missing_ok=True)


def _address(url: str) -> str:
    return RedisSettings(url=url).address()
