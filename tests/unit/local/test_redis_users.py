"""The local stack's Redis users (tandem.local.redis_users) on the real Redis at 127.0.0.1:6379: one
per component, passwords kept in the cache folder (0600) and reused, each process given only its own
user and password file, and a clear error from a Redis that is not ours to administer. Users are
named after a test prefix (``acltest-…``) and deleted after."""

from __future__ import annotations

import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tandem.common import redis_acl
from tandem.gateway.settings import GatewaySettings
from tandem.local.redis_users import RedisUsersError, drop_users, ensure_users
from tandem.local.stack import LocalStack, StackConfig

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def prefix() -> Iterator[str]:
    key_prefix = f"acltest-{uuid.uuid4().hex[:8]}"
    yield key_prefix
    client = redis.Redis.from_url(REDIS_URL)
    client.execute_command("ACL", "DELUSER", *[redis_acl.username(c, key_prefix) for c in redis_acl.COMPONENTS])
    client.close()


def test_users_are_made_once_with_private_passwords_reused_at_the_next_start(prefix: str, tmp_path: Path) -> None:
    logins = ensure_users(REDIS_URL, prefix, tmp_path)
    assert sorted(logins) == sorted(redis_acl.COMPONENTS)
    gateway = logins["gateway"]
    assert gateway.username == f"{prefix}-gateway"
    assert stat.S_IMODE(gateway.password_file.stat().st_mode) == 0o600
    password = gateway.password_file.read_text()
    again = ensure_users(REDIS_URL, prefix, tmp_path)
    assert again["gateway"].password_file.read_text() == password

    client = redis.Redis.from_url(gateway.url(REDIS_URL))
    try:
        assert client.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set(f"{prefix}:gw:key:{'ab' * 32}", "{}")
    finally:
        client.close()

    drop_users(REDIS_URL, prefix, tmp_path)
    root = redis.Redis.from_url(REDIS_URL)
    try:
        assert f"{prefix}-gateway".encode() not in root.execute_command("ACL", "USERS")
    finally:
        root.close()
    assert not gateway.password_file.exists()


def test_each_process_gets_its_own_user_and_a_password_file_never_the_password(prefix: str, tmp_path: Path) -> None:
    config = StackConfig.with_free_ports(key_prefix=prefix, redis_users_dir=tmp_path)
    stack = LocalStack(config)
    stack._ensure_redis_users()
    try:
        envs = {"gateway": stack._gateway_env(), "router": stack._router_env(), "worker": stack._worker_env("decode")}
        for component, env in envs.items():
            service = component.upper()
            assert env[f"TANDEM_{service}_REDIS__USERNAME"] == f"{prefix}-{component}"
            password_file = Path(env[f"TANDEM_{service}_REDIS__PASSWORD_FILE"])
            assert password_file.parent == tmp_path
            assert password_file.read_text().strip() not in "".join(env.values())
        # The gateway reads them back as it starts, and logs in as itself.
        settings = GatewaySettings(
            redis={
                "url": envs["gateway"]["TANDEM_GATEWAY_REDIS__URL"],
                "username": envs["gateway"]["TANDEM_GATEWAY_REDIS__USERNAME"],
                "password_file": envs["gateway"]["TANDEM_GATEWAY_REDIS__PASSWORD_FILE"],
            }
        )
        client = redis.Redis.from_url(settings.redis.connection_url())
        try:
            assert client.ping()  # a wrong password would raise here
            with pytest.raises(redis.exceptions.NoPermissionError):  # the gateway's rights, not the default's
                client.set(f"{prefix}:gw:tenant:acme", "{}")
        finally:
            client.close()
        assert stack.admin_redis_url.startswith(f"redis://{prefix}-admin:")
    finally:
        stack.stop()
    assert stack.redis_logins == {} and not list(tmp_path.iterdir())  # a test's stack leaves nothing


def test_a_redis_that_is_not_ours_to_administer_stops_the_stack_with_what_to_do(prefix: str, tmp_path: Path) -> None:
    """Logged in as a user that may not run ACL SETUSER (here: a gateway's), the stack cannot make the users."""
    logins = ensure_users(REDIS_URL, prefix, tmp_path / "first")
    with pytest.raises(RedisUsersError, match=r"ACL SETUSER.*redis_users=False"):
        ensure_users(logins["gateway"].url(REDIS_URL), f"{prefix}x", tmp_path / "second")


def test_without_users_every_process_logs_in_as_the_url_user(prefix: str, tmp_path: Path) -> None:
    config = StackConfig.with_free_ports(key_prefix=prefix, redis_users=False, redis_users_dir=tmp_path)
    stack = LocalStack(config)
    stack._ensure_redis_users()
    assert "TANDEM_GATEWAY_REDIS__USERNAME" not in stack._gateway_env()
    assert stack.admin_redis_url == config.redis_url and not list(tmp_path.iterdir())
