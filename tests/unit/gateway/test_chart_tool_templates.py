"""The gateway reads the tool chat templates the chart gives the models form (issue 41): the
TANDEM_GATEWAY_MODELS value ``helm template`` renders (tests/chart/tool_templates.py) parses into each
ServedModel's tool_chat_template: ``default`` the shipped SmolLM2 template (a file that exists), ``""`` none
(``tool_choice: "auto"`` refused), a ConfigMap's key or a path as that path. The single-model setting
(TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE) takes the same words."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.gateway.settings import SMOLLM2_TOOL_TEMPLATE, GatewaySettings
from tests.chart.tool_templates import MODELS, gateway_env, render_models


def test_the_rendered_models_parse_into_each_models_tool_template(monkeypatch: pytest.MonkeyPatch) -> None:
    env = gateway_env(render_models(MODELS))
    for name, value in env.items():
        if name.startswith("TANDEM_GATEWAY_"):
            monkeypatch.setenv(name, value)
    settings = GatewaySettings()
    assert [m.name for m in settings.models] == [m["name"] for m in MODELS]
    templates = {m.name: m.tool_chat_template for m in settings.models}
    assert templates == {
        "smol": SMOLLM2_TOOL_TEMPLATE,
        "Llama-3.1-8B-Instruct": None,
        "Qwen/Qwen2.5-7B-Instruct": Path("/etc/tandem/tool-templates/2/qwen_tools.jinja"),
        "other": SMOLLM2_TOOL_TEMPLATE,
        "SmolLM2-360M-Instruct": None,
        "mistral": Path("/models/mistral/tools.jinja"),
    }
    assert SMOLLM2_TOOL_TEMPLATE.is_file()
    assert "<tool_call>" in SMOLLM2_TOOL_TEMPLATE.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("default", SMOLLM2_TOOL_TEMPLATE), ("", None), ("/etc/t/tools.jinja", Path("/etc/t/tools.jinja"))],
)
def test_the_single_model_setting_takes_the_same_words(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: Path | None
) -> None:
    monkeypatch.delenv("TANDEM_GATEWAY_MODELS", raising=False)
    monkeypatch.setenv("TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE", value)
    assert GatewaySettings().default_model.tool_chat_template == expected
