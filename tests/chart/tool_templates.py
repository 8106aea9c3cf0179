"""The chart's models form with each model's tool chat template (``tandemDeployment.models[].toolChatTemplate``,
issue 41): values that exercise every way of naming one, rendered by helm, and the gateway's container as
rendered. Shared by tests/chart/test_tool_templates.py and the gateway's parse of the rendered value
(tests/unit/gateway/test_chart_tool_templates.py)."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

import yaml

from tests.chart.conftest import CHART, RELEASE, run_helm

#: One model per way of naming a tool template: unset on a SmolLM2 model (the shipped one), unset on
#: Llama 3.1 (its family's), a ConfigMap's key, "default" named explicitly, "" on a SmolLM2 model, a path,
#: unset on Qwen2.5 told by its path only, unset on a family Tandem has no template for, unset on a Qwen2.5
#: model whose tool format differs (Math), the family templates named on models of other names, and three
#: with the format of their calls given (``toolCallParser``).
MODELS: list[dict[str, Any]] = [
    {"name": "smol", "path": "/models/SmolLM2-135M-Instruct"},
    {"name": "Llama-3.1-8B-Instruct", "path": "/models/Llama-3.1-8B-Instruct"},
    {
        "name": "Qwen/Qwen2.5-7B-Instruct",
        "path": "/models/qwen",
        "toolChatTemplate": {"configMap": "qwen-tools", "key": "qwen_tools.jinja"},
    },
    {"name": "other", "path": "/models/other", "toolChatTemplate": "default"},
    {"name": "SmolLM2-360M-Instruct", "path": "/models/smol-360m", "toolChatTemplate": ""},
    {"name": "mistral", "path": "/models/mistral", "toolChatTemplate": "/models/mistral/tools.jinja"},
    {"name": "chat", "path": "/models/Qwen2.5-7B-Instruct"},
    {"name": "Mistral-7B-Instruct-v0.3", "path": "/models/mistral-7b"},
    {"name": "Qwen/Qwen2.5-Math-7B-Instruct", "path": "/models/qwen-math"},
    {"name": "tuned-a", "path": "/models/a", "toolChatTemplate": "qwen2.5"},
    {"name": "tuned-b", "path": "/models/b", "toolChatTemplate": "llama3.1-json"},
    # The format of the calls given beside the template: a ConfigMap's template in the Llama JSON form, a
    # path's in the Hermes form said explicitly, and a family's template with the format it has anyway.
    {
        "name": "custom-llama",
        "path": "/models/custom-llama",
        "toolChatTemplate": {"configMap": "llama-tools", "key": "llama_werkzeuge.jinja"},
        "toolCallParser": "llama3_json",
    },
    {
        "name": "custom-hermes",
        "path": "/models/custom-hermes",
        "toolChatTemplate": "/models/custom-hermes/tools.jinja",
        "toolCallParser": "hermes",
    },
    {"name": "Llama-3.1-70B-Instruct", "path": "/models/llama-70b", "toolCallParser": "llama3_json"},
]


def render_models(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``helm template`` of the models form with ``models`` (each on the claim ``models``)."""
    values = {"tandemDeployment": {"models": [{**m, "pvc": {"claimName": "models"}} for m in models]}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(values, f)
        f.flush()
        out = run_helm("template", RELEASE, str(CHART), "--namespace", "tandem", "-f", f.name).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_single(model: dict[str, Any]) -> list[dict[str, Any]]:
    """``helm template`` of the single-model form with these ``model`` values."""
    values = {"model": model}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(values, f)
        f.flush()
        out = run_helm("template", RELEASE, str(CHART), "--namespace", "tandem", "-f", f.name).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def gateway_container(docs: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gateway Deployment's pod spec and its ``gateway`` container."""
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{RELEASE}-tandem-gateway"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "gateway"]
    return pod, container


def gateway_env(docs: Sequence[dict[str, Any]]) -> dict[str, str]:
    _, container = gateway_container(docs)
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}
