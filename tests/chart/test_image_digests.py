"""images.<x>.digest: the release workflow publishes images by digest, and a digest takes precedence
over the tag in every pod the chart renders and every pool the operator creates from its
TandemDeployment (the CR carries the digest; the operator's ImageSpec builds repository@digest)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.conftest import CHART, ROOT, find, render, run_helm, values_args
from tests.chart.crd_schema import validate_custom_resource
from tests.chart.test_chart import _operator_pools, _pod_specs

#: values key -> the repository its default points at
IMAGES = {
    "gateway": "ghcr.io/tandem-llm/tandem-gateway",
    "router": "ghcr.io/tandem-llm/tandem-router",
    "workerCpu": "ghcr.io/tandem-llm/tandem-worker-cpu",
    "workerGpu": "ghcr.io/tandem-llm/tandem-worker-gpu",
    "operator": "ghcr.io/tandem-llm/tandem-operator",
    "redis": "docker.io/library/redis",
}
SCRIPT = ROOT / "scripts" / "set_image_digests.py"
#: A distinct digest per image, so a template that took another image's digest is caught.
DIGESTS = {key: "sha256:" + format(i + 1, "x") * 64 for i, key in enumerate(IMAGES)}


def _images(docs: tuple[dict[str, Any], ...]) -> dict[str, set[str]]:
    """Every container image, by repository, in the chart's pods and the operator's pools."""
    pods = _pod_specs(docs) + [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in _operator_pools(docs)
        if d["kind"] == "Deployment"
    ]
    found: dict[str, set[str]] = {}
    for _, pod in pods:
        for container in pod.get("initContainers", []) + pod["containers"]:
            image = container["image"]
            repository = image.split("@")[0] if "@" in image else image.rsplit(":", 1)[0]
            found.setdefault(repository, set()).add(image)
    return found


@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_a_digest_takes_precedence_over_the_tag_everywhere(accelerator: str) -> None:
    extra = [f"images.{key}.digest={digest}" for key, digest in DIGESTS.items()]
    extra += [f"images.{key}.tag=9.9.9" for key in IMAGES]  # ignored once a digest is set
    extra += ["redis.enabled=true", f"accelerator={accelerator}"]
    if accelerator == "gpu":
        extra += [
            "tandemDeployment.pools.prefill.resources.limits.nvidia\\.com/gpu=1",
            "tandemDeployment.pools.decode.resources.limits.nvidia\\.com/gpu=1",
        ]
    docs = render(None, tuple(extra))
    images = _images(docs)
    worker = "workerGpu" if accelerator == "gpu" else "workerCpu"
    expected = {key: {f"{IMAGES[key]}@{DIGESTS[key]}"} for key in ("gateway", "router", "operator", "redis", worker)}
    assert {IMAGES[key]: value for key, value in expected.items()} == images
    (td,) = find(docs, "TandemDeployment")
    assert td["spec"]["image"]["digest"] == DIGESTS[worker]
    validate_custom_resource(td)


def test_without_a_digest_images_are_pulled_by_tag_or_the_charts_app_version() -> None:
    docs = render(None, ("redis.enabled=true", "images.gateway.tag=1.2.3"))
    app_version = next(
        line.split(":", 1)[1].strip().strip('"')
        for line in (CHART / "Chart.yaml").read_text().splitlines()
        if line.startswith("appVersion:")
    )
    images = _images(docs)
    assert images[IMAGES["gateway"]] == {f"{IMAGES['gateway']}:1.2.3"}
    for key in ("router", "operator", "workerCpu"):
        assert images[IMAGES[key]] == {f"{IMAGES[key]}:{app_version}"}, key
    assert images[IMAGES["redis"]] == {f"{IMAGES['redis']}:7.4-alpine"}
    (td,) = find(docs, "TandemDeployment")
    assert "digest" not in td["spec"]["image"]


@pytest.mark.parametrize(
    "digest",
    ["sha256:abc", "sha512:" + "a" * 64, "sha256:" + "A" * 64, "latest", "sha256:" + "a" * 64 + "\n"],
)
def test_a_malformed_digest_is_refused_at_render_time(digest: str) -> None:
    proc = run_helm(
        "template", "rel", str(CHART), *values_args(None, (f"images.gateway.digest={digest}",)), check=False
    )
    assert proc.returncode != 0
    assert "digest" in proc.stderr, proc.stderr


def test_the_release_script_makes_the_packaged_charts_defaults_pull_by_digest(tmp_path: Path) -> None:
    """scripts/set_image_digests.py on a copy of the chart (what the release workflow publishes): its
    defaults, rendered with no values at all, pull every image by its digest."""
    chart = tmp_path / "tandem"
    shutil.copytree(CHART, chart)
    pairs = [f"{key}={digest}" for key, digest in DIGESTS.items()]
    subprocess.run([sys.executable, str(SCRIPT), str(chart / "values.yaml"), *pairs], check=True, timeout=60)
    out = run_helm("template", "rel", str(chart), "--namespace", "tandem", "--set", "redis.enabled=true").stdout
    docs = tuple(doc for doc in yaml.safe_load_all(out) if doc)
    images = _images(docs)
    assert images == {
        IMAGES[key]: {f"{IMAGES[key]}@{DIGESTS[key]}"}
        for key in ("gateway", "router", "operator", "redis", "workerCpu")
    }
    # The comments and the other values are untouched: only the digest lines changed.
    before = (CHART / "values.yaml").read_text().splitlines()
    after = (chart / "values.yaml").read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert [b.strip() for _, b in changed] == [f'digest: "{DIGESTS[key]}"' for key in IMAGES]


@pytest.mark.parametrize("pair", ["gateway=sha256:abc", "nosuchimage=sha256:" + "a" * 64, "gateway"])
def test_the_release_script_refuses_what_it_cannot_write(tmp_path: Path, pair: str) -> None:
    values = tmp_path / "values.yaml"
    shutil.copy(CHART / "values.yaml", values)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(values), pair], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert values.read_text() == (CHART / "values.yaml").read_text()


def test_the_release_workflow_publishes_every_dockerfile_under_its_values_key() -> None:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    matrix = workflow["jobs"]["images"]["strategy"]["matrix"]["include"]
    dockerfiles = {p.name.removesuffix(".Dockerfile") for p in (ROOT / "docker").glob("*.Dockerfile")}
    assert {m["image"] for m in matrix} == dockerfiles
    values = yaml.safe_load((CHART / "values.yaml").read_text())["images"]
    for m in matrix:
        assert values[m["key"]]["repository"].endswith(f"/tandem-{m['image']}"), m
        assert "linux/amd64" in m["platforms"].split(","), m
    assert {m["image"] for m in matrix if "linux/arm64" in m["platforms"]} >= dockerfiles - {"worker-gpu"}
    # every image's digest reaches the chart step's digest script
    chart_steps = " ".join(step.get("run", "") for step in workflow["jobs"]["chart"]["steps"])
    for m in matrix:
        assert f"{m['key']}=${{{{ needs.images.outputs.{m['key']} }}}}" in chart_steps, m
