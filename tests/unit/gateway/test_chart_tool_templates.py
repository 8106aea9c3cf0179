"""The gateway reads the tool chat templates the chart gives the models form (issue 41): the
TANDEM_GATEWAY_MODELS value ``helm template`` renders (tests/chart/tool_templates.py) parses into each
ServedModel's tool_chat_template and tool-call format: a shipped template's name (``default`` SmolLM2's,
``qwen2.5``, ``llama3.1-json``: files that exist) that file, ``""`` none (``tool_choice: "auto"`` refused), a
ConfigMap's key or a path as that path, each read in the format its ``toolCallParser`` gives (the schema's
formats are the gateway's). The single-model form's TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE, rendered by helm too,
takes the same words, and a format its template cannot have stops the gateway at start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

from tandem.gateway.api.tools import ToolCallFormat
from tandem.gateway.settings import (
    LLAMA31_JSON_TOOL_TEMPLATE,
    NAMED_TOOL_TEMPLATES,
    QWEN25_TOOL_TEMPLATE,
    SMOLLM2_TOOL_TEMPLATE,
    GatewaySettings,
)
from tests.chart.conftest import CHART, render
from tests.chart.tool_templates import MODELS, gateway_env, render_models, render_single


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
        # toolCallParser given: a ConfigMap's template read in the Llama JSON form, a path's in Hermes.
        "custom-llama": (Path("/etc/tandem/tool-templates/11/llama_werkzeuge.jinja"), "llama3_json"),
        "custom-hermes": (Path("/models/custom-hermes/tools.jinja"), "hermes"),
        "Llama-3.1-70B-Instruct": (LLAMA31_JSON_TOOL_TEMPLATE, "llama3_json"),
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


def test_the_charts_call_formats_are_the_ones_the_gateway_reads() -> None:
    """values.schema.json's enum of toolCallParser, in both forms, is tandem.gateway.api.tools.ToolCallFormat."""
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    single = schema["properties"]["model"]["properties"]["toolCallParser"]["enum"]
    models = schema["properties"]["tandemDeployment"]["properties"]["models"]["items"]["properties"]
    assert single == models["toolCallParser"]["enum"] == list(get_args(ToolCallFormat))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        # Llama 3.1 gets its family's template, whose calls are not Hermes blocks.
        ({"servedModelName": "Llama-3.1-8B-Instruct", "toolCallParser": "hermes"}, "disagrees"),
        ({"servedModelName": "mine", "toolChatTemplate": "qwen2.5", "toolCallParser": "llama3_json"}, "disagrees"),
        # A family without a template: a format would not make auto work.
        ({"servedModelName": "Mistral-7B-Instruct-v0.3", "toolCallParser": "llama3_json"}, "no tool chat template"),
    ],
)
def test_a_call_format_the_template_cannot_have_stops_the_gateway_at_start(
    monkeypatch: pytest.MonkeyPatch, model: dict[str, str], message: str
) -> None:
    """The chart renders what its schema allows; the gateway refuses the disagreement when it starts."""
    for name, value in gateway_env(render_single(model)).items():
        if name.startswith("TANDEM_GATEWAY_"):
            monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=message) as refused:
        GatewaySettings()
    assert "TANDEM_GATEWAY_TOOL_CALL_PARSER" in str(refused.value)
