"""charts/tandem: Redis with one ACL user per component (values ``redis.auth``; docs/security.md).

The chart's ACL file is the one tandem.common.redis_acl writes (the single source of the rules), a real
redis-server loads it, each component's pod reads only its own user's URL, the admin's credentials are
mounted nowhere, and the in-chart Redis's default user is off."""

from __future__ import annotations

import base64
import hashlib
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from tandem_operator.reconcile import Owner, desired_objects
from tandem_operator.spec import parse_spec

from tandem.common import redis_acl
from tests.chart.conftest import CHART, RELEASE, find, one, render, run_helm, values_args
from tests.kit.redis import start_redis

FULL = f"{RELEASE}-tandem"
SECRET = f"{FULL}-redis"


def _secret(docs: tuple[dict[str, Any], ...], name: str = SECRET) -> dict[str, str]:
    secret = one(docs, "Secret", name)
    data = dict(secret.get("stringData") or {})
    data.update({k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()})
    return data


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env", [])}


def _redis_key(env: dict[str, Any], name: str) -> str:
    ref = env[name]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == SECRET
    return str(ref["key"])


def _worker_pods(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    (td,) = find(docs, "TandemDeployment")
    owner = Owner(name=td["metadata"]["name"], namespace="tandem", uid="uid-1", labels={}, generation=1)
    objects = desired_objects(owner, parse_spec(td["spec"]), {"prefill": None, "decode": None})
    return [d["spec"]["template"]["spec"] for d in objects if d["kind"] == "Deployment"]


def test_the_charts_acl_file_is_the_one_redis_acl_writes() -> None:
    data = _secret(render(None))
    lines = data["users.acl"].strip().splitlines()
    # Not "off": Redis replays its AOF as the default user (tests/faults/test_redis_durability.py).
    default_hash = hashlib.sha256(data["default-password"].encode()).hexdigest()
    assert lines[0] == f"user default on #{default_hash} ~* &* +@all"
    assert len(data["default-password"]) >= 32
    expected = [redis_acl.acl_file_line(c, "tandem", data[f"{c}-password"]) for c in redis_acl.COMPONENTS]
    assert lines[1:] == expected
    for component in redis_acl.COMPONENTS:
        url = urlsplit(data[f"{component}-url"])
        assert (url.username, url.password) == (f"tandem-{component}", data[f"{component}-password"])
        assert (url.hostname, url.port, url.path) == (f"{FULL}-redis", 6379, "/0")
        assert len(data[f"{component}-password"]) >= 32


def test_a_real_redis_loads_the_charts_users_and_enforces_them(tmp_path: Path) -> None:
    data = _secret(render(None, ("redis.keyPrefix=team-a",)))
    acl_file = tmp_path / "users.acl"
    acl_file.write_text(data["users.acl"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_redis(port, "--aclfile", str(acl_file))
    try:
        def login(component: str) -> redis.Redis:
            url = urlsplit(data[f"{component}-url"])
            return redis.Redis(port=port, username=url.username, password=url.password)

        anonymous = redis.Redis(port=port)
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.get("team-a:gw:key:x")  # the default user is off: no password-less access
        gateway = login("gateway")
        assert gateway.get("team-a:gw:key:x") is None
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.set("team-a:gw:key:x", "{}")
        worker = login("worker")
        assert worker.set("team-a:worker:w1", "{}")
        with pytest.raises(redis.exceptions.NoPermissionError):
            login("router").set("team-a:worker:w1", "{}")
        assert login("admin").set("team-a:gw:key:x", "{}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_each_pod_gets_only_its_own_users_url_and_the_admins_is_mounted_nowhere() -> None:
    docs = render(None)
    gateway = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert _redis_key(_env(gateway), "TANDEM_GATEWAY_REDIS__URL") == "gateway-url"
    (service,) = find(docs, "RayService")
    ray = service["spec"]["rayClusterConfig"]
    router_containers = [ray["headGroupSpec"]["template"]["spec"]["containers"][0]] + [
        group["template"]["spec"]["containers"][0] for group in ray["workerGroupSpecs"]
    ]
    for container in router_containers:
        assert _redis_key(_env(container), "TANDEM_ROUTER_REDIS__URL") == "router-url"
    pods = _worker_pods(docs)
    assert len(pods) == 2
    for pod in pods:
        assert _redis_key(_env(pod["containers"][0]), "TANDEM_WORKER_REDIS__URL") == "worker-url"
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = str(doc)
        assert "admin-url" not in text and "admin-password" not in text, doc["metadata"]["name"]
        assert "default-password" not in text, doc["metadata"]["name"]
        assert "users.acl" not in text or doc["metadata"]["name"] == f"{FULL}-redis", doc["metadata"]["name"]


def test_the_in_chart_redis_loads_the_users_with_its_default_user_locked() -> None:
    docs = render(None)
    pod = one(docs, "Deployment", f"{FULL}-redis")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--aclfile") + 1] == "/etc/redis/acl/users.acl"
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "acl"]
    assert volume["secret"] == {
        "secretName": SECRET,
        "items": [{"key": "users.acl", "path": "users.acl"}],
        "defaultMode": 0o440,
    }
    assert {"name": "acl", "mountPath": "/etc/redis/acl", "readOnly": True} in container["volumeMounts"]
    assert "checksum/acl-rules" in pod["metadata"]["annotations"]
    assert "NOAUTH" in " ".join(container["readinessProbe"]["exec"]["command"])


def test_an_external_redis_gets_a_url_per_user_on_its_own_host() -> None:
    docs = render("ci/values-external-redis-initcontainer.yaml")
    data = _secret(docs)
    for component in ("gateway", "router", "worker", "admin"):
        url = urlsplit(data[f"{component}-url"])
        assert (url.username, url.hostname, url.port, url.path) == (
            f"tandem-{component}",
            "redis.example.internal",
            6379,
            "/3",
        )
    assert not find(docs, "Deployment", f"{FULL}-redis")
    tls = _secret(render(None, ("redis.enabled=false", "redis.externalUrl=rediss://r.example:6380/0?ssl_ca_certs=/ca.crt")))
    assert tls["gateway-url"].startswith("rediss://tandem-gateway:")
    assert tls["gateway-url"].endswith("@r.example:6380/0?ssl_ca_certs=/ca.crt")


def test_with_auth_off_every_component_reads_the_one_url_as_before() -> None:
    docs = render(None, ("redis.auth.enabled=false",))
    data = _secret(docs)
    assert set(data) == {"url"}
    gateway = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert _redis_key(_env(gateway), "TANDEM_GATEWAY_REDIS__URL") == "url"
    redis_pod = one(docs, "Deployment", f"{FULL}-redis")["spec"]["template"]["spec"]
    assert "--aclfile" not in redis_pod["containers"][0]["args"]


def test_a_key_prefix_that_would_widen_the_acl_patterns_is_refused() -> None:
    for bad in ("a*", "a b", "tandem:x"):
        proc = run_helm("template", RELEASE, str(CHART), *values_args(None, (f"redis.keyPrefix={bad}",)), check=False)
        assert proc.returncode != 0 and "keyPrefix" in proc.stderr, bad
