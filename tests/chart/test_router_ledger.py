"""The router replicas' ledger secret in the chart: generated into a Secret (or an existing one), mounted
read-only in every router pod, and named by the variable the router's own settings read."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from tests.chart.conftest import VALUES_MATRIX, find, one, render

FULL = "rel-tandem"


def _router_pods(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    cluster = one(docs, "RayService", f"{FULL}-router")["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]


def _secret_file(pod: dict[str, Any]) -> tuple[str, str]:
    """(the file the router container is told to read, the Secret mounted there)."""
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    path = env["TANDEM_ROUTER_LEDGER__SECRET_FILE"]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert path == f"{mount['mountPath']}/secret"  # the Secret's key
    return path, volume["secret"]["secretName"]


@pytest.mark.parametrize("values", VALUES_MATRIX, ids=lambda v: v or "defaults")
def test_every_router_pod_reads_the_generated_secret(values: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = pytest.importorskip("tandem.router.settings", reason="the router package (make setup)")
    docs = render(values)
    if not find(docs, "RayService"):
        pytest.skip("no router in these values")
    secret = one(docs, "Secret", f"{FULL}-router-ledger")
    assert len(base64.b64decode(secret["data"]["secret"])) >= 32
    for pod in _router_pods(docs):
        path, name = _secret_file(pod)
        assert name == f"{FULL}-router-ledger"
        monkeypatch.setenv("TANDEM_ROUTER_LEDGER__SECRET_FILE", path)
        assert str(settings.TandemRouterSettings().ledger.secret_file) == path


def test_an_existing_secret_replaces_the_generated_one() -> None:
    docs = render(None, ("router.ledgerSecret.existingSecret=my-ledger",))
    assert not find(docs, "Secret", f"{FULL}-router-ledger")
    assert {_secret_file(pod)[1] for pod in _router_pods(docs)} == {"my-ledger"}
