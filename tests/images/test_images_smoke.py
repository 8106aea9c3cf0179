"""The CPU images together (``make images-test``, after ``make images``): the router, a prefill and a
decode worker and the gateway, each a container of its image on the host's network, Redis the host's;
a chat answer streamed through the gateway container with the openai SDK from the host.

Not part of ``make test`` (it needs the images, and their start takes minutes on two cores)."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tandem.local.stack import StackConfig, default_model_dir
from tests.images.container_stack import IMAGE_OF_MODULE, IMAGE_UID, ContainerStack, image_name, probe_podman

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

COMPONENTS = {"router": "router", "prefill": "worker-cpu", "decode": "worker-cpu", "gateway": "gateway"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ContainerStack]:
    for name in sorted(set(IMAGE_OF_MODULE.values())):
        if not _image_exists(image_name(name)):
            pytest.fail(f"image {image_name(name)} is missing: run `make images` first")
    podman, errors = probe_podman(image_name("gateway"))
    assert podman is not None, "no way to run a container here:\n" + "\n".join(errors)
    secrets_dir = Path(tmp_path_factory.mktemp("image-secrets"))
    secrets_dir.chmod(0o755)
    # The model as the pods see their volume: readable by the images' user (the chart's fsGroup); the
    # prepared model's weights are root's, mode 0600.
    model_dir = Path(tmp_path_factory.mktemp("image-model")) / default_model_dir().name
    shutil.copytree(default_model_dir(), model_dir)
    subprocess.run(["chown", "-R", f"{IMAGE_UID}:{IMAGE_UID}", str(model_dir)], check=True)
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-img-{uuid.uuid4().hex[:8]}",
        log_dir=Path(tmp_path_factory.mktemp("image-logs")),
        model_dir=model_dir,
        pki_dir=secrets_dir / "pki",
        redis_users_dir=secrets_dir / "redis-users",
        router_ledger_secret_file=secrets_dir / "router-ledger-secret",
        min_uncached_tokens_to_disaggregate=0,  # every prompt goes prefill -> decode over KV gRPC
    )
    stack = ContainerStack(
        config, podman, secrets_dir=secrets_dir, progress=lambda msg: print(f"[images] {msg}", flush=True)
    )
    started_s = time.monotonic()
    try:
        stack.start(timeout_s=900)
    except BaseException:
        for name in COMPONENTS:
            print(f"--- {name} log tail ---\n{stack.tail(name, 60)}")
        stack.stop()
        raise
    print(f"[images] stack of containers ready in {time.monotonic() - started_s:.0f} s", flush=True)
    yield stack
    stack.stop()


def _image_exists(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], check=False).returncode == 0


def test_every_component_is_a_container_of_its_image_as_the_images_user(stack: ContainerStack) -> None:
    for name, image in COMPONENTS.items():
        state = stack.container_state(name)
        assert state["status"] == "running", (name, state)
        assert state["image"] == image_name(image), (name, state)
        assert state["user"] == f"{IMAGE_UID}:{IMAGE_UID}", (name, state)
        assert stack.is_running(name)


def test_openai_sdk_streams_a_chat_answer_through_the_gateway_container(stack: ContainerStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.config.gateway_url}/v1", api_key=stack.api_key or "unused", timeout=300)
    # Non-ASCII and markup in the prompt: the gateway container's tokenizer and the workers' engine see
    # the same text as the venv's would.
    prompt = "Réponds en un mot : quelle est la capitale de la France ? <b>«ünïcødé»</b> 東京 ✓"
    stream = client.chat.completions.create(
        model=stack.config.served_model_name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    finish_reasons: list[str] = []
    usage = None
    chunks = 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    text = "".join(pieces)
    assert chunks > 2 and len(pieces) > 1, (chunks, pieces)  # streamed piece by piece, not one body
    assert text.strip(), text
    assert finish_reasons in (["stop"], ["length"]), finish_reasons
    assert usage is not None and 0 < usage.completion_tokens <= 24 and usage.prompt_tokens > 20, usage
    # The same question without streaming answers the same text (temperature 0, one model).
    whole = client.chat.completions.create(
        model=stack.config.served_model_name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
    )
    assert whole.choices[0].message.content == text


def test_gateway_container_refuses_a_bad_key_in_openai_shape(stack: ContainerStack) -> None:
    response = httpx.post(
        f"{stack.config.gateway_url}/v1/chat/completions",
        headers={"Authorization": "Bearer sk-not-a-key' OR '1'='1 <script>"},
        json={"model": stack.config.served_model_name, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert response.status_code == 401
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert "127.0.0.1" not in response.text and "Traceback" not in response.text
