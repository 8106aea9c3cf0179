"""The chart's NOTES work verbatim (issue 43, item 5): the endpoint's scheme follows ``ingress.tls.enabled``
(not whether the ``tls`` map is empty), every variable the commands use is set by an earlier command, the
model named is one the release serves, and the line that captures the API key captures it from the real
admin CLI's output (``python -m tandem.gateway.admin`` against the real Redis, its ``admin`` function
replaced by a local one: kubectl is the only thing not run)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid

import pytest
import redis.asyncio as aioredis

from tandem.gateway.tenancy.store import TenantStore
from tests.chart.conftest import CHART, ROOT, helm_path
from tests.kit.redis import delete_prefix

REDIS_URL = os.environ.get("TANDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _notes(*sets: str) -> str:
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(
        [helm_path(), "install", "rel", str(CHART), "--dry-run=client", "-n", "tandem", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


def _commands(notes: str) -> list[str]:
    """The indented command lines (what a reader pastes), continuation lines joined."""
    lines = [line.strip() for line in notes.splitlines() if line.startswith("     ")]
    return [c for c in re.split(r"\n", "\n".join(lines).replace("\\\n", " ")) if c]


@pytest.mark.parametrize(
    ("sets", "url"),
    [
        ((), "URL=http://localhost:8080"),
        (("gateway.ingress.enabled=true", "gateway.ingress.host=llm.example.com"), "URL=http://llm.example.com"),
        (
            (
                "gateway.ingress.enabled=true",
                "gateway.ingress.host=llm.example.com",
                "gateway.ingress.tls.enabled=true",
            ),
            "URL=https://llm.example.com",
        ),
        (("gateway.service.type=LoadBalancer",), "URL=http://$(kubectl -n tandem get svc rel-tandem-gateway"),
    ],
)
def test_every_variable_is_set_before_it_is_used(sets: tuple[str, ...], url: str) -> None:
    commands = _commands(_notes(*sets))
    assert any(c.startswith(url) for c in commands), commands
    set_at = {m.group(1): i for i, c in enumerate(commands) if (m := re.match(r"^([A-Z]+)=", c))}
    for i, command in enumerate(commands):
        for var in re.findall(r"\$([A-Z]+)\b", command):
            assert var in set_at and set_at[var] < i, f"${var} used before it is set: {command}"
    assert any("$URL/v1/chat/completions" in c and "Bearer $KEY" in c for c in commands)


def test_the_model_named_is_served_in_the_models_form() -> None:
    notes = _notes("tandemDeployment.models[0].name=Qwen/Qwen2.5-0.5B", "tandemDeployment.models[0].pvc.claimName=m")
    assert '"model":"Qwen/Qwen2.5-0.5B"' in notes


@pytest.mark.parametrize("auth", ["true", "false"])
def test_the_key_line_captures_the_key_the_real_admin_cli_prints(auth: str) -> None:
    commands = _commands(_notes(f"redis.auth.enabled={auth}"))
    (create_tenant,) = [c for c in commands if c.startswith("admin tenant create")]
    (key_line,) = [c for c in commands if c.startswith("KEY=")]
    prefix = f"tandem-notes-{uuid.uuid4().hex[:8]}"
    admin = f'admin() {{ "{sys.executable}" -m tandem.gateway.admin "$@"; }}'
    script = f"set -euo pipefail\n{admin}\n{create_tenant} >/dev/null\n{key_line}\nprintf '%s' \"$KEY\"\n"
    env = {**os.environ, "TANDEM_GATEWAY_REDIS__URL": REDIS_URL, "TANDEM_GATEWAY_TENANCY__KEY_PREFIX": prefix}
    proc = subprocess.run(["bash", "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    try:
        assert proc.returncode == 0, proc.stderr
        key = proc.stdout
        assert key, "the NOTES' key line captured nothing"
        found = asyncio.run(_lookup(prefix, key))
        assert found == "demo"
    finally:
        asyncio.run(_delete(prefix))


async def _lookup(prefix: str, key: str) -> str | None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        found = await TenantStore(client, key_prefix=prefix).lookup_key(key)
        return None if found is None else found[1].id
    finally:
        await client.aclose()


async def _delete(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await delete_prefix(client, prefix)
    finally:
        await client.aclose()
