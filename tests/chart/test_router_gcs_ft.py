"""The router's Ray head with GCS fault tolerance on the chart's Redis (issue 43 item 5): KubeRay's
``gcsFaultToleranceOptions`` in the RayService's cluster, checked against KubeRay's own RayService CRD
(v1.6.2, tests/chart/kuberay/), with the Redis user ``<prefix>-raygcs`` that a real Redis loading the
chart's ACL file lets touch Ray's keys and nothing of Tandem's."""

from __future__ import annotations

import functools
import gzip
import json
import socket
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis
import yaml

from tandem.common import redis_acl
from tests.chart.conftest import CHART, RELEASE, VALUES_MATRIX, find, one, render, run_helm
from tests.chart.crd_schema import _strict
from tests.kit.redis import start_redis

KUBERAY_CRD = Path(__file__).parent / "kuberay" / "ray.io_rayservices.yaml.gz"
FULL = f"{RELEASE}-tandem"
SECRET = f"{FULL}-redis"


@functools.cache
def _rayservice_schema() -> dict[str, Any]:
    crd = yaml.safe_load(gzip.decompress(KUBERAY_CRD.read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = _strict(version["schema"]["openAPIV3Schema"])
    return schema


def _validate(rayservice: dict[str, Any]) -> None:
    jsonschema.validate(rayservice, _rayservice_schema())


def _ft(docs: tuple[dict[str, Any], ...]) -> dict[str, Any] | None:
    cluster = one(docs, "RayService", f"{FULL}-router")["spec"]["rayClusterConfig"]
    options: dict[str, Any] | None = cluster.get("gcsFaultToleranceOptions")
    return options


@pytest.mark.parametrize("values", VALUES_MATRIX, ids=lambda v: v or "defaults")
def test_every_rendered_rayservice_fits_kuberays_crd(values: str | None) -> None:
    for ray in find(render(values), "RayService"):
        _validate(ray)


def test_kuberays_crd_catches_a_misspelt_option() -> None:
    ray = json.loads(json.dumps(one(render(None), "RayService", f"{FULL}-router")))
    _validate(ray)
    options = ray["spec"]["rayClusterConfig"].pop("gcsFaultToleranceOptions")
    ray["spec"]["rayClusterConfig"]["gcsFaultToleranceOption"] = options
    with pytest.raises(jsonschema.ValidationError):
        _validate(ray)


def test_the_chart_redis_keeps_the_heads_state_under_its_own_user() -> None:
    docs = render(None)
    options = _ft(docs)
    assert options == {
        "redisAddress": f"{FULL}-redis:6379",
        "redisUsername": {"value": "tandem-raygcs"},
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": SECRET, "key": "raygcs-password"}}},
        "externalStorageNamespace": redis_acl.gcs_storage_namespace("tandem"),
    }
    secret = one(docs, "Secret", SECRET)["stringData"]
    assert len(secret["raygcs-password"]) >= 32
    # KubeRay refuses a head that also sets these itself (utils/validation.go), and the annotation form.
    cluster = one(docs, "RayService", f"{FULL}-router")["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    env = {e["name"] for c in head["template"]["spec"]["containers"] for e in c.get("env", [])}
    assert not env & {"RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "REDIS_USERNAME", "RAY_external_storage_namespace"}
    assert not {"redis-password", "redis-username"} & set(head["rayStartParams"])
    assert "ray.io/ft-enabled" not in (one(docs, "RayService", f"{FULL}-router")["metadata"].get("annotations") or {})


def test_without_auth_the_chart_redis_needs_no_password() -> None:
    options = _ft(render(None, ("redis.auth.enabled=false",)))
    assert options == {"redisAddress": f"{FULL}-redis:6379", "externalStorageNamespace": "tandem-raygcs"}


@pytest.mark.parametrize(
    ("sets", "on"),
    [
        (("router.gcsFaultTolerance.enabled=false",), False),
        # An external Redis: off unless asked for (the chart does not know its address).
        (("redis.enabled=false", "redis.externalUrl=redis://r.example:6379/0"), False),
        # The chart's Redis with a Secret of the user's: its users are theirs, so on only when asked for.
        (("redis.existingSecret=mine",), False),
        (("redis.existingSecret=mine", "router.gcsFaultTolerance.enabled=true"), True),
    ],
)
def test_the_switch(sets: tuple[str, ...], on: bool) -> None:
    options = _ft(render(None, sets))
    assert (options is not None) == on
    if options is not None:
        assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "raygcs-password"}


def test_an_external_redis_for_the_head() -> None:
    sets = (
        "redis.enabled=false", "redis.externalUrl=redis://r.example:6379/0",
        "router.gcsFaultTolerance.enabled=true", "router.gcsFaultTolerance.redisAddress=gcs.example:6380",
        "router.gcsFaultTolerance.username=ray", "router.gcsFaultTolerance.passwordSecret.name=gcs-redis",
    )  # fmt: skip
    docs = render(None, sets)
    assert _ft(docs) == {
        "redisAddress": "gcs.example:6380",
        "redisUsername": {"value": "ray"},
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "gcs-redis", "key": "password"}}},
        "externalStorageNamespace": "tandem-raygcs",
    }
    _validate(one(docs, "RayService", f"{FULL}-router"))


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            (
                "redis.enabled=false",
                "redis.externalUrl=redis://r.example:6379/0",
                "router.gcsFaultTolerance.enabled=true",
            ),
            "set redisAddress",
        ),
        (("router.gcsFaultTolerance.passwordSecret.name=x",), "are for redisAddress's Redis"),
    ],
)
def test_render_time_refusals(sets: tuple[str, ...], message: str) -> None:
    args = [arg for s in sets for arg in ("--set", s)]
    proc = run_helm("template", RELEASE, str(CHART), *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_an_address_that_is_not_host_port_fails_the_schema() -> None:
    proc = run_helm(
        "template", RELEASE, str(CHART), "--set", "router.gcsFaultTolerance.redisAddress=redis://x", check=False
    )
    assert proc.returncode != 0 and "redisAddress" in proc.stderr


def test_a_real_redis_lets_the_heads_user_touch_rays_keys_alone(tmp_path: Path) -> None:
    """The commands Ray's GCS sends (redis_acl._RAY_GCS_COMMANDS, read with MONITOR from a real head), on
    the keys of its storage namespace, under the chart's ACL file; Tandem's keys and other namespaces refused."""
    secret = one(render(None, ("redis.keyPrefix=team-a",)), "Secret", SECRET)["stringData"]
    acl_file = tmp_path / "users.acl"
    acl_file.write_text(secret["users.acl"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_redis(port, "--aclfile", str(acl_file))
    try:
        gcs = redis.Redis(port=port, username="team-a-raygcs", password=secret["raygcs-password"])
        table = f"RAY{redis_acl.gcs_storage_namespace('team-a')}@KV"
        assert gcs.hset(table, "serve:checkpoint", "état ☃ \x00\xff") == 1
        assert gcs.hsetnx(table, "serve:checkpoint", "x") == 0
        assert gcs.hget(table, "serve:checkpoint") == "état ☃ \x00\xff".encode()
        assert gcs.hscan(table)[1] and gcs.incrby(f"RAY{redis_acl.gcs_storage_namespace('team-a')}@JobCounter", 1) == 1
        assert gcs.info("cluster") is not None and gcs.delete("DUMMY") == 0
        with pytest.raises(redis.exceptions.NoPermissionError):
            gcs.hset("DUMMY", "k", "v")  # its probe key: DEL alone
        assert gcs.delete(table) == 1
        for refused in ("team-a:gw:key:x", "RAYother@KV", "team-a:worker:w1"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                gcs.hget(refused, "k")
        with pytest.raises(redis.exceptions.NoPermissionError):
            gcs.get(table)  # not a command Ray's GCS uses
    finally:
        proc.terminate()
        proc.wait(timeout=10)
