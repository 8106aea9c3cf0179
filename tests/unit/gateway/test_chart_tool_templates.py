"""The gateway reads the tool chat templates the chart gives the models form (issue 41): the
TANDEM_GATEWAY_MODELS value ``helm template`` renders (tests/chart/tool_templates.py) parses into each
ServedModel's tool_chat_template and tool-call format: a shipped template's name (``default`` SmolLM2's,
``qwen2.5``, ``llama3.1-json``: files that exist) that file, ``""`` none (``tool_choice: "auto"`` refused), a
ConfigMap's key or a path as that path. The single-model form's TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE, rendered
by helm too, takes the same words."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.gateway.settings import (
    LLAMA31_JSON_TOOL_TEMPLATE,
    NAMED_TOOL_TEMPLATES,
    QWEN25_TOOL_TEMPLATE,
    SMOLLM2_TOOL_TEMPLATE,
    GatewaySettings,
)
from tests.chart.conftest import render
from tests.chart.tool_templates import MODELS, gateway_env, render_models


def test_the_rendered_models_parse_into_each_models_tool_template(monkeypatch: pytest.MonkeyPatch) -> None:
    env = gateway_env(render_models(MODELS))
    for name, value in env.items():
        if name.startswith("TANDEM_GATEWAY_"):
            monkeypatch.setenv(name, value)
    settings = GatewaySettings()
    assert [m.name for m in settings.models] == [m["name"] for m in MODELS]
    templates = {m.name: (m.tool_chat_template, m.tool_call_format) for m in settings.models}
    assert templates == {
        "smol": (SMOLLM2_TOOL_TEMPLATE, "hermes"),
        "Llama-3.1-8B-Instruct": (LLAMA31_JSON_TOOL_TEMPLATE, "llama3_json"),
        "Qwen/Qwen2.5-7B-Instruct": (Path("/etc/tandem/tool-templates/2/qwen_tools.jinja"), "hermes"),
        "other": (SMOLLM2_TOOL_TEMPLATE, "hermes"),
        "SmolLM2-360M-Instruct": (None, "hermes"),
        "mistral": (Path("/models/mistral/tools.jinja"), "hermes"),
        "chat": (QWEN25_TOOL_TEMPLATE, "hermes"),
        "Mistral-7B-Instruct-v0.3": (None, "hermes"),
        "Qwen/Qwen2.5-Math-7B-Instruct": (None, "hermes"),
        "tuned-a": (QWEN25_TOOL_TEMPLATE, "hermes"),
        "tuned-b": (LLAMA31_JSON_TOOL_TEMPLATE, "llama3_json"),
    }
    for path, _ in NAMED_TOOL_TEMPLATES.values():
        assert path.is_file()
    assert "<tool_call>" in SMOLLM2_TOOL_TEMPLATE.read_text(encoding="utf-8")
    assert "<tool_call>" in QWEN25_TOOL_TEMPLATE.read_text(encoding="utf-8")
    assert '"parameters"' in LLAMA31_JSON_TOOL_TEMPLATE.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("values", "template", "call_format"),
    [
        (None, SMOLLM2_TOOL_TEMPLATE, "hermes"),  # the default SmolLM2-135M-Instruct
        ("examples/values-gpu.yaml", LLAMA31_JSON_TOOL_TEMPLATE, "llama3_json"),  # Llama-3.1-8B-Instruct
    ],
)
def test_the_single_model_form_gives_the_gateway_its_familys_template(
    monkeypatch: pytest.MonkeyPatch, values: str | None, template: Path, call_format: str
) -> None:
    for name, value in gateway_env(list(render(values))).items():
        if name.startswith("TANDEM_GATEWAY_"):
            monkeypatch.setenv(name, value)
    (model,) = GatewaySettings().models
    assert (model.tool_chat_template, model.tool_call_format) == (template, call_format)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("default", SMOLLM2_TOOL_TEMPLATE),
        ("qwen2.5", QWEN25_TOOL_TEMPLATE),
        ("llama3.1-json", LLAMA31_JSON_TOOL_TEMPLATE),
        ("", None),
        ("/etc/t/tools.jinja", Path("/etc/t/tools.jinja")),
    ],
)
def test_the_single_model_setting_takes_the_same_words(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: Path | None
) -> None:
    monkeypatch.delenv("TANDEM_GATEWAY_MODELS", raising=False)
    monkeypatch.setenv("TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE", value)
    assert GatewaySettings().default_model.tool_chat_template == expected
