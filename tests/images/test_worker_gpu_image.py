"""The GPU worker image (``make images IMAGES=worker-gpu``) as far as a host without a GPU can check it:
its Python imports vllm and a CUDA build of torch, its entrypoint answers ``--help``, its user, ports
and entrypoint are what the operator's worker pods expect (``tandem_operator.resources``), it runs
under the pods' read-only root filesystem with only ``/tmp`` writable, and a worker started on a host
with no GPU exits with a clear message, not a traceback.

Skipped when the image is missing (building it takes about half an hour and 15 GB); not part of
``make test`` (``make/images.mk`` ignores ``tests/images`` there). Nothing here runs on a GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tandem_operator.resources import HEALTH_PORT, KV_PORT, METRICS_PORT, WORKER_PORT

from tandem.local.stack import default_model_dir
from tests.images.container_stack import IMAGE_UID, Podman, image_name, probe_podman

IMAGE = image_name("worker-gpu")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        subprocess.run(["podman", "image", "exists", IMAGE], check=False, capture_output=True).returncode != 0,
        reason=f"{IMAGE} is not built (make images IMAGES=worker-gpu)",
    ),
]

#: What the operator's worker pod gives the container (tandem_operator.resources.build_pool_deployment):
#: a read-only root filesystem, an emptyDir at /tmp (HOME=/tmp), nothing else writable.
POD_LIKE = ("--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,mode=1777")


@pytest.fixture(scope="module")
def podman() -> Iterator[Podman]:
    found, errors = probe_podman(IMAGE)
    assert found is not None, "no way to run a container here:\n" + "\n".join(errors)
    yield found


def _run(podman: Podman, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = podman.run_command("--rm", "--no-healthcheck", "--network", "none", *POD_LIKE, *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)


def test_image_config_is_what_the_worker_pods_expect() -> None:
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{json .Config}}", IMAGE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    config = json.loads(out)
    # The pods run as runAsUser/runAsGroup 10001 with runAsNonRoot: a numeric non-root user.
    assert config["User"] == f"{IMAGE_UID}:{IMAGE_UID}", config["User"]
    # The pods give only args (["--role", role]): the entrypoint must start the worker.
    assert config["Entrypoint"] == ["python", "-m", "tandem.worker"], config["Entrypoint"]
    exposed = {int(port.split("/")[0]) for port in config.get("ExposedPorts", {})}
    assert exposed >= {WORKER_PORT, KV_PORT, METRICS_PORT, HEALTH_PORT}, exposed
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["HOME"] == "/tmp" and env["HF_HUB_OFFLINE"] == "1", env
    assert env["TANDEM_WORKER_PORT"] == str(WORKER_PORT) and env["TANDEM_WORKER_KV__PORT"] == str(KV_PORT), env
    assert config["Labels"]["org.opencontainers.image.title"] == "tandem-worker-gpu", config["Labels"]


def test_python_imports_vllm_and_a_cuda_torch_on_a_read_only_root(podman: Podman) -> None:
    code = (
        "import json, vllm, torch, tandem.worker.engine; "
        "print(json.dumps([vllm.__version__, torch.__version__, torch.version.cuda]))"
    )
    result = _run(podman, "--entrypoint", "python", IMAGE, "-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    vllm_version, torch_version, cuda_version = json.loads(result.stdout.strip().splitlines()[-1])
    assert vllm_version == "0.32.0", vllm_version
    # vllm's CUDA wheel, not a CPU build of torch (a host's find-links folder must not reach the build).
    assert torch_version.startswith("2.13.0") and "+cpu" not in torch_version, torch_version
    assert cuda_version is not None and cuda_version.startswith("13."), cuda_version


def test_entrypoint_answers_help(podman: Podman) -> None:
    result = _run(podman, IMAGE, "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "python -m tandem.worker" in result.stdout and "--role" in result.stdout, result.stdout


def test_a_worker_on_a_host_without_a_gpu_exits_with_a_clear_message(podman: Podman, tmp_path: Path) -> None:
    # The model as the pods see their volume: readable by the image's user (the chart's fsGroup).
    model_dir = tmp_path / "model"
    shutil.copytree(default_model_dir(), model_dir)
    subprocess.run(["chown", "-R", f"{IMAGE_UID}:{IMAGE_UID}", str(model_dir)], check=True)
    result = _run(
        podman,
        "--volume",
        f"{model_dir.resolve()}:/models/model:ro",
        "--env",
        "TANDEM_WORKER_ENGINE__MODEL_DIR=/models/model",
        "--env",
        "TANDEM_WORKER_REDIS__URL=redis://127.0.0.1:1/0",
        IMAGE,
        "--role",
        "decode",
        timeout_s=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "GPU" in output, output[-3000:]
