"""Helm rendering helpers for the chart tests. Helm comes from `make helm`
(.tools/helm) or $HELM; a missing helm fails the tests, it does not skip them."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
CRD_PATH = CHART / "crds" / "tandemdeployments.tandem.dev.yaml"
#: Every values file the chart is rendered with (None = the defaults).
VALUES_MATRIX: list[str | None] = [
    None,
    "examples/values-cpu-demo.yaml",
    "examples/values-gpu.yaml",
    "examples/values-gpu-two-models.yaml",
    "ci/values-everything.yaml",
    "ci/values-external-redis-initcontainer.yaml",
]
RELEASE = "rel"


def helm_path() -> str:
    helm = os.environ.get("HELM") or str(ROOT / ".tools" / "helm")
    if not Path(helm).is_file():
        pytest.fail(f"helm not found at {helm}: run `make helm` (or set HELM)", pytrace=False)
    return helm


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([helm_path(), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def values_args(values: str | None, extra: tuple[str, ...] = ()) -> list[str]:
    args = ["-f", str(CHART / values)] if values else []
    for item in extra:
        args += ["--set", item]
    return args


@functools.cache
def render(
    values: str | None, extra: tuple[str, ...] = (), api_versions: tuple[str, ...] = ()
) -> tuple[dict[str, Any], ...]:
    """The chart's manifests; ``api_versions``: what the cluster serves beyond the defaults (cert-manager.io/v1)."""
    served = [arg for version in api_versions for arg in ("--api-versions", version)]
    out = run_helm("template", RELEASE, str(CHART), "--namespace", "tandem", "--include-crds",
                   *served, *values_args(values, extra)).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, got {[d['metadata']['name'] for d in find(docs, kind)]}"
    return found[0]


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())
