"""A plain vLLM OpenAI server on the same model: the colocated baseline.

Used by ``make bench-path`` (side-by-side speed) and by the integration tests
that compare Tandem's answers with what one colocated engine gives
(``tests/integration/test_text_fidelity.py``). It is vLLM's own server
(``vllm.entrypoints.openai.api_server``), nothing of Tandem's in it; the
engine settings match the local stack's workers (float32 on CPU, eager mode,
the same context length and KV size), so differences are the architecture's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


class PlainVLLMError(RuntimeError):
    """The plain vLLM server exited or did not become healthy in time."""


def start_plain_vllm(
    model_dir: Path,
    name: str,
    port: int,
    log: Path,
    *,
    cpu_threads_bind: str = "0",
    max_model_len: int = 4096,
    kv_cache_bytes: int = 1 << 30,
    timeout_s: float = 600.0,
    extra_args: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], float]:
    """Start the server and wait for ``/health``; returns the process and its start-up time in seconds.
    ``extra_args``: more of the server's flags (e.g. ``--enable-lora`` and its modules)."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind, "PYTHONUNBUFFERED": "1"}
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--enable-prefix-caching",
        *extra_args,
    ]
    started = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(args, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PlainVLLMError(f"plain vLLM exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_plain_vllm(proc)
    raise PlainVLLMError(f"plain vLLM did not become healthy in {timeout_s:.0f} s; see {log}")


def stop_plain_vllm(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM its process group (the engine core is a child), SIGKILL after ``timeout_s``."""
    import signal

    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
