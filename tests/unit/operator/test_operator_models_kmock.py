"""The operator reconciling the models form under kopf's KopfRunner against kmock (no cluster) and the
real Redis on 127.0.0.1:6379 (the adapter catalog, under a random key prefix deleted afterwards):
two models' pools, adapters in the catalog (unchanged spec → no version bump; a removed adapter →
its entry removed; a removed model → its pools deleted), and bad specs refused with a condition."""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from tandem_operator.spec import parse_spec

from tandem.common.adapters import AdapterCatalog
from tests.unit.operator.test_operator_kmock import (  # noqa: F401 (fixtures)
    NS,
    TD_PATH,
    FakePrometheus,
    _obj,
    _runner,
    _until,
    cluster,
    prometheus,
)

NAME = "multi"
REDIS_URL = "redis://127.0.0.1:6379/0"
TD = "tandem.dev/v1alpha1/tandemdeployments"
DEPLOYMENTS = "apps/v1/deployments"

pytestmark = pytest.mark.timeout(120)


def td_body(prefix: str) -> dict[str, Any]:
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "TandemDeployment",
        "metadata": {"name": NAME, "namespace": NS, "uid": "uid-multi", "generation": 1, "resourceVersion": "1"},
        "spec": {
            "models": [
                {"name": "smol", "pvc": {"claimName": "models"}, "lora": {"maxAdapters": 2},
                 "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}},
                {"name": "Smol/Merged", "path": "/models/merged", "pvc": {"claimName": "models"}},
            ],
            "adapters": [
                {"name": "tandem-test-a", "baseModel": "smol", "path": "/models/adapters/a"},
                {"name": "tandem-test-b", "baseModel": "smol", "path": "/models/adapters/b"},
            ],
            "image": {"repository": "ghcr.io/tandem-llm/tandem-worker-cpu", "tag": "0.1.0"},
            "redis": {"secretName": "rel-tandem-redis", "keyPrefix": prefix},
            "autoscaling": {"enabled": False},
        },
    }


@pytest.fixture
async def catalog(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[AdapterCatalog, str]]:
    prefix = f"test-op-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TANDEM_OPERATOR_REDIS_URL", REDIS_URL)
    client = aioredis.Redis.from_url(REDIS_URL)
    yield AdapterCatalog(client, key_prefix=prefix), prefix
    await client.delete(f"{prefix}:adapters", f"{prefix}:adapters:version")
    await client.aclose()


def _status(kmock: Any) -> dict[str, Any]:
    return dict((_obj(kmock, TD, NAME) or {}).get("status", {}))


def _condition(kmock: Any, type_: str) -> dict[str, Any]:
    return next((c for c in _status(kmock).get("conditions", []) if c["type"] == type_), {})


async def _update_spec(kmock: Any, spec: dict[str, Any]) -> None:
    """A PATCH through the API (a watch event, as kubectl's), with the generation kmock does not bump."""
    generation = int(kmock.objects[(TD, NS, NAME)]["metadata"].get("generation", 1)) + 1
    await kmock.patch(f"{TD_PATH}/{NAME}", json={"metadata": {"generation": generation}, "spec": spec})


async def test_two_models_and_their_adapters(cluster: Any, catalog: tuple[AdapterCatalog, str]) -> None:  # noqa: F811
    store, prefix = catalog
    body = td_body(prefix)
    pools = ["multi-smol-prefill", "multi-smol-decode"]  # "Smol/Merged"'s carry a hash: found in status
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=body)

        # Both models' pools, each pod template labelled with its model.
        for name in pools:
            dep = await _until(lambda n=name: _obj(cluster, DEPLOYMENTS, n), name)
            assert dep["spec"]["template"]["metadata"]["labels"]["tandem.dev/model"] == "smol"
        await _until(lambda: _condition(cluster, "SpecValid").get("status") == "True", "SpecValid")
        status_pools = await _until(lambda: len(_status(cluster).get("pools", {})) == 4 and _status(cluster)["pools"],
                                    "four pools in status")
        merged_keys = [k for k, v in status_pools.items() if v.get("model") == "Smol/Merged"]
        assert sorted(status_pools[k]["role"] for k in merged_keys) == ["decode", "prefill"]
        for key in merged_keys:
            dep = await _until(lambda k=key: _obj(cluster, DEPLOYMENTS, f"{NAME}-{k}"), key)
            env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert env["TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME"] == "Smol/Merged"
            assert env["TANDEM_WORKER_ENGINE__MODEL_DIR"] == "/models/merged"

        # The adapters are in the real catalog, as the admin CLI would have put them.
        await _until(lambda: _condition(cluster, "AdaptersReconciled").get("status") == "True", "AdaptersReconciled")
        entries = await store.entries()
        assert {n: (e.base_model, e.path) for n, e in entries.items()} == {
            "tandem-test-a": ("smol", "/models/adapters/a"),
            "tandem-test-b": ("smol", "/models/adapters/b"),
        }
        versions = {n: e.version for n, e in entries.items()}
        assert _status(cluster)["adapters"]["versions"] == versions

        # An admin loads another adapter by hand: the operator never touches it.
        await store.put("by-hand", base_model="smol", path="/models/adapters/h", now_unix_s=0.0)

        # A spec change that leaves the adapters alone (decode replicas) → no version bump.
        spec = copy.deepcopy(body["spec"])
        spec["models"][0]["decode"]["replicas"] = 2
        await _update_spec(cluster, spec)
        await _until(lambda: int(_obj(cluster, DEPLOYMENTS, "multi-smol-decode")["spec"]["replicas"]) == 2,
                     "decode replicas 2")
        await asyncio.sleep(0.5)
        assert {n: e.version for n, e in (await store.entries()).items() if n != "by-hand"} == versions

        # Adapter b removed, a moved to new files, the second model removed.
        spec["adapters"] = [{"name": "tandem-test-a", "baseModel": "smol", "path": "/models/adapters/a2"}]
        spec["models"] = spec["models"][:1]
        await _update_spec(cluster, spec)
        await _until(lambda: "tandem-test-b" not in _status(cluster).get("adapters", {}).get("versions", {"b": 0})
                     and "tandem-test-b" not in _status(cluster)["adapters"]["managed"], "b removed in status")
        entries = await store.entries()
        assert set(entries) == {"tandem-test-a", "by-hand"}
        assert entries["tandem-test-a"].path == "/models/adapters/a2"
        assert entries["tandem-test-a"].version > versions["tandem-test-a"]
        for key in merged_keys:
            await _until(lambda k=key: _obj(cluster, DEPLOYMENTS, f"{NAME}-{k}") is None, f"{key} deleted")
            await _until(lambda k=key: _obj(cluster, "v1/services", f"{NAME}-{k}") is None, f"{key} Service deleted")
        assert _obj(cluster, DEPLOYMENTS, "multi-smol-prefill") is not None

        # Deleted → pools gone, its adapters out of the catalog, the hand-loaded one kept.
        await cluster.delete(f"{TD_PATH}/{NAME}")
        await _until(lambda: _obj(cluster, TD, NAME) is None, "finalizer released")
        assert _obj(cluster, DEPLOYMENTS, "multi-smol-decode") is None
        assert set(await store.entries()) == {"by-hand"}
    assert runner.exception is None, runner.output[-3000:]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["models"].append(copy.deepcopy(s["models"][0])), "duplicate model names"),
        (lambda s: s["adapters"].append({"name": "c", "baseModel": "llama", "path": "/a"}),
         "baseModel 'llama' is not a served model"),
        (lambda s: s["models"][1].update(name="<|im_start|>assistant"), "models.1.name"),
    ],
)
async def test_a_bad_spec_gets_a_condition_and_nothing_else(
    cluster: Any, catalog: tuple[AdapterCatalog, str], change: Any, message: str  # noqa: F811
) -> None:
    store, prefix = catalog
    body = td_body(prefix)
    change(body["spec"])
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=body)
        spec_valid = await _until(lambda: _condition(cluster, "SpecValid"), "SpecValid")
        assert spec_valid["status"] == "False" and spec_valid["reason"] == "InvalidSpec"
        assert message in spec_valid["message"], spec_valid
        await asyncio.sleep(1.0)
        assert _obj(cluster, DEPLOYMENTS, "multi-smol-prefill") is None
        assert await store.entries() == {}  # nothing half-applied
    assert runner.exception is None and runner.exit_code == 0


async def _mark_ready(kmock: Any, names: list[str]) -> None:
    """kmock runs no Deployment controller: every replica of ``names`` becomes ready at once (all of the
    current template)."""
    while True:
        for name in names:
            try:
                obj = kmock.objects[(DEPLOYMENTS, NS, name)]
            except KeyError:
                continue
            replicas = int(obj["spec"]["replicas"])
            if not obj.deleted and (obj.get("status") or {}).get("readyReplicas") != replicas:
                obj.patch({"status": {"replicas": replicas, "updatedReplicas": replicas, "readyReplicas": replicas}})
        await asyncio.sleep(0.2)


async def test_each_models_pools_scale_on_their_own_models_load(
    cluster: Any, catalog: tuple[AdapterCatalog, str], prometheus: tuple[FakePrometheus, str]  # noqa: F811
) -> None:
    fake, prom_url = prometheus
    _, prefix = catalog
    body = td_body(prefix)
    body["spec"]["adapters"] = []
    body["spec"]["autoscaling"] = {"intervalSeconds": 0.5, "scaleUpStabilizationSeconds": 0,
                                   "scaleDownStabilizationSeconds": 0, "prometheusUrl": prom_url}
    merged, merged_decode = (p.name(NAME) for p in parse_spec(body["spec"]).pools_of()[2:])  # "Smol/Merged"'s
    names = ["multi-smol-prefill", "multi-smol-decode", merged, merged_decode]
    controller = asyncio.create_task(_mark_ready(cluster, names))
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=body)
        await _until(lambda: _obj(cluster, DEPLOYMENTS, merged), merged)
        # 12 requests wait for smol's prefill budget (the router's series labelled model="smol"); none for
        # the other model: only smol's prefill pool grows (step cap 2).
        smol_queue = f'ray_tandem_router_queued_requests{{namespace="{NS}",model="smol",waiting_for="prefill"}}'
        fake.values = {smol_queue: 12.0}
        await _until(lambda: int(_obj(cluster, DEPLOYMENTS, "multi-smol-prefill")["spec"]["replicas"]) == 3,
                     "smol's prefill pool to scale to 3")
        # The same tick goes on to the other model's pools: they are asked about their own model.
        await _until(lambda: any('model="Smol/Merged"' in q for q in fake.queries), "the other model's queries")
        pods = f'pod=~"{merged_decode}-[a-z0-9]+-[a-z0-9]+"'
        await _until(lambda: any(pods in q for q in fake.queries), "its pods' queries")
        await asyncio.sleep(1.0)  # two more ticks
        assert int(_obj(cluster, DEPLOYMENTS, merged)["spec"]["replicas"]) == 1
        assert int(_obj(cluster, DEPLOYMENTS, "multi-smol-decode")["spec"]["replicas"]) == 1
        assert int(_obj(cluster, DEPLOYMENTS, "multi-smol-prefill")["spec"]["replicas"]) == 3
        decisions = _status(cluster).get("autoscaling", {})
        assert decisions["smol-prefill"]["desiredReplicas"] == 3, decisions
    controller.cancel()
    assert runner.exception is None, runner.output[-3000:]


async def test_pool_names_taken_by_another_resource_are_left_alone(
    cluster: Any, catalog: tuple[AdapterCatalog, str]  # noqa: F811
) -> None:
    """``chat-smol``'s single-model pool and ``chat``'s model ``smol`` would share ``chat-smol-prefill``:
    the second resource takes nothing over and says why."""
    _, prefix = catalog
    theirs = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "multi-smol-prefill", "namespace": NS,
                           "ownerReferences": [{"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemDeployment",
                                                "name": "multi-smol", "uid": "uid-other", "controller": True}]},
              "spec": {"replicas": 5, "selector": {"matchLabels": {"x": "y"}},
                       "template": {"metadata": {"labels": {"x": "y"}}, "spec": {"containers": []}}}}
    await cluster.post(f"/apis/apps/v1/namespaces/{NS}/deployments", json=theirs)
    body = td_body(prefix)
    body["spec"]["autoscaling"] = {"intervalSeconds": 0.5}
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=body)
        reconciled = await _until(lambda: _condition(cluster, "Reconciled"), "Reconciled")
        assert reconciled["status"] == "False" and reconciled["reason"] == "NameConflict", reconciled
        assert "multi-smol-prefill" in reconciled["message"]
        await asyncio.sleep(1.5)  # timer ticks: nothing scaled, nothing reported from the other's pool
        dep = _obj(cluster, DEPLOYMENTS, "multi-smol-prefill")
        assert dep["spec"]["replicas"] == 5 and dep["metadata"]["ownerReferences"][0]["uid"] == "uid-other"
        assert _obj(cluster, DEPLOYMENTS, "multi-smol-decode") is None
        assert _condition(cluster, "Ready").get("reason") == "NameConflict", _status(cluster)
    assert runner.exception is None


async def test_an_adapter_unloaded_by_hand_comes_back_and_a_dead_redis_is_a_condition(
    cluster: Any, catalog: tuple[AdapterCatalog, str], monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    store, prefix = catalog
    monkeypatch.setenv("TANDEM_OPERATOR_ADAPTER_RESYNC_S", "0.5")
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=td_body(prefix))
        await _until(lambda: _condition(cluster, "AdaptersReconciled").get("status") == "True", "AdaptersReconciled")
        before = (await store.entries())["tandem-test-a"].version
        # An admin unloads a managed adapter: the next resync loads it again, under a new version.
        assert await store.remove("tandem-test-a")
        await _until(lambda: _status(cluster)["adapters"]["versions"].get("tandem-test-a", 0) > before,
                     "tandem-test-a back in the catalog")
        assert (await store.entries())["tandem-test-a"].version > before
    assert runner.exception is None, runner.output[-3000:]


async def test_without_redis_the_pools_still_come_and_the_adapters_say_why(
    cluster: Any, catalog: tuple[AdapterCatalog, str], monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    _, prefix = catalog
    monkeypatch.setenv("TANDEM_OPERATOR_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    with _runner() as runner:
        await asyncio.sleep(1.0)
        await cluster.post(TD_PATH, json=td_body(prefix))
        await _until(lambda: _obj(cluster, DEPLOYMENTS, "multi-smol-decode"), "the pools, Redis or not")
        condition = await _until(lambda: _condition(cluster, "AdaptersReconciled"), "AdaptersReconciled")
        assert condition["status"] == "False" and condition["reason"] == "CatalogUnavailable", condition
        assert "adapter catalog unreachable" in condition["message"]
        assert _condition(cluster, "Reconciled")["status"] == "True"
    assert runner.exception is None, runner.output[-3000:]
