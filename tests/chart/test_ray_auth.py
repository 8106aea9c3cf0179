"""Ray's token authentication on the router's Ray cluster (issue 43): KubeRay's ``authOptions`` in the
RayService, checked against KubeRay's own RayService CRD (v1.6.2, tests/chart/kuberay/). KubeRay does the rest
(v1.6.2, ray-operator/controllers/ray): it generates the token into a Secret of its own per RayCluster
(``raycluster_controller.go``, reconcileAuthSecret; key ``auth_token``) unless ``secretName`` names one, sets
``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` (from that Secret) on every Ray container where the pod does
not set them already (``common/pod.go``, SetContainerTokenAuthEnvVars), and sends the token on its own dashboard
calls (``utils/util.go``, GetRayDashboardClientFunc). So the chart holds no token, and sets neither variable
itself (one set by the chart would win over KubeRay's). The real head's behaviour under that env:
tests/integration/test_ray_auth.py."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml

from tests.chart.conftest import CHART, RELEASE, VALUES_MATRIX, find, helm_path, one, render, run_helm
from tests.chart.test_router_gcs_ft import _validate

FULL = f"{RELEASE}-tandem"


def _cluster(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "RayService", f"{FULL}-router")["spec"]["rayClusterConfig"]
    return spec


def _ray_pods(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def _env_names(cluster: dict[str, Any]) -> set[str]:
    return {
        e["name"]
        for pod in _ray_pods(cluster)
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
        for e in c.get("env", [])
    }


@pytest.mark.parametrize("values", VALUES_MATRIX, ids=lambda v: v or "defaults")
def test_every_rendered_rayservice_carries_token_auth(values: str | None) -> None:
    docs = render(values)
    if not find(docs, "RayService"):
        pytest.skip("no router in these values")
    cluster = _cluster(docs)
    assert cluster["authOptions"] == {"mode": "token"}
    assert not {n for n in _env_names(cluster) if n.startswith("RAY_AUTH")}
    _validate(one(docs, "RayService", f"{FULL}-router"))


def test_disabled_turns_it_off_explicitly() -> None:
    docs = render(None, ("ray.auth.mode=disabled",))
    cluster = _cluster(docs)
    assert cluster["authOptions"] == {"mode": "disabled"}
    assert not {n for n in _env_names(cluster) if n.startswith("RAY_AUTH")}
    _validate(one(docs, "RayService", f"{FULL}-router"))


def test_an_existing_secret_is_named_never_rendered() -> None:
    docs = render(None, ("ray.auth.existingSecret=ray-token.team-a",))
    assert _cluster(docs)["authOptions"] == {"mode": "token", "secretName": "ray-token.team-a"}
    assert not find(docs, "Secret", "ray-token.team-a")
    _validate(one(docs, "RayService", f"{FULL}-router"))
    # Without token mode a secret name means nothing to KubeRay: it is left out.
    disabled = render(None, ("ray.auth.existingSecret=ray-token.team-a", "ray.auth.mode=disabled"))
    assert _cluster(disabled)["authOptions"] == {"mode": "disabled"}


def test_a_new_generation_changes_the_cluster_spec() -> None:
    """KubeRay builds a new RayCluster when the spec's hash changes (the replicas aside): a new token."""
    before = _cluster(render(None))
    after = _cluster(render(None, ("ray.auth.generation=2",)))
    assert "annotations" not in before["headGroupSpec"]["template"]["metadata"]
    assert after["headGroupSpec"]["template"]["metadata"]["annotations"] == {"tandem.dev/ray-auth-generation": "2"}
    before["headGroupSpec"]["template"]["metadata"]["annotations"] = {"tandem.dev/ray-auth-generation": "2"}
    assert before == after


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("ray.auth.mode=none",), "/ray/auth/mode"),
        (("ray.auth.mode=Token",), "/ray/auth/mode"),
        (("ray.auth.existingSecret=Ray Token ☃",), "/ray/auth/existingSecret"),
        (("ray.auth.tokn=x",), "tokn"),
        # KubeRay refuses token mode below Ray 2.52.0 (utils/validation.go); the chart says so at once.
        (("router.rayVersion=2.51.9",), "needs router.rayVersion 2.52.0 or later"),
    ],
)
def test_render_time_refusals(sets: tuple[str, ...], message: str) -> None:
    args = [arg for s in sets for arg in ("--set", s)]
    proc = run_helm("template", RELEASE, str(CHART), *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_an_old_ray_may_run_with_auth_disabled() -> None:
    docs = render(None, ("router.rayVersion=2.51.9", "ray.auth.mode=disabled"))
    assert _cluster(docs)["authOptions"] == {"mode": "disabled"}


@pytest.mark.parametrize(
    "sets", [(), ("ray.auth.existingSecret=mine",), ("ray.auth.mode=disabled",)], ids=["defaults", "existing", "off"]
)
def test_no_token_in_any_manifest_or_the_notes(sets: tuple[str, ...]) -> None:
    """What ``helm install`` shows and applies (manifests and NOTES): no token, no Secret key of one, and no
    Ray auth variable with a value of its own (KubeRay's RAY_AUTH_TOKEN comes from its Secret)."""
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(
        [helm_path(), "install", RELEASE, str(CHART), "--dry-run=client", "-n", "tandem", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    manifests, notes = proc.stdout.split("NOTES:", 1)
    docs = [d for d in yaml.safe_load_all(manifests.split("MANIFEST:", 1)[1]) if d]
    applied = yaml.safe_dump_all(docs)  # what reaches the cluster: the template's comments are not
    for text in (applied, notes):
        assert "auth_token" not in text and "RAY_AUTH" not in text
    assert find(tuple(docs), "RayService")
    for secret in find(tuple(docs), "Secret"):
        keys = set(secret.get("data") or {}) | set(secret.get("stringData") or {})
        assert not {k for k in keys if "ray" in k.lower() and "token" in k.lower()}, secret["metadata"]["name"]
