"""Each model of the chart's models form names its tool chat template (issue 41): the gateway's
TANDEM_GATEWAY_MODELS carries it per model, a ConfigMap named for a model is mounted on the gateway where
that model's setting points, the default follows the model's family in both chart forms (SmolLM2: the
shipped "default"; Llama 3.1: "llama3.1-json"; Qwen2.5: "qwen2.5"; any other: none, ``tool_choice: "auto"``
refused), and the TandemDeployment never sees the field (the CRD and
the operator do not know it). The gateway's parse of the rendered value:
tests/unit/gateway/test_chart_tool_templates.py."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from tests.chart.conftest import render
from tests.chart.crd_schema import validate_custom_resource
from tests.chart.test_models_chart import K8S_VERSION
from tests.chart.tool_templates import MODELS, gateway_container, gateway_env, render_models, render_single


def test_each_model_gets_its_tool_template_in_the_gateways_models() -> None:
    served = json.loads(gateway_env(render_models(MODELS))["TANDEM_GATEWAY_MODELS"])
    assert [m["name"] for m in served] == [m["name"] for m in MODELS]
    assert [m["tool_chat_template"] for m in served] == [
        "default",  # unset, SmolLM2 by its path: the shipped template, as in the single-model form
        "llama3.1-json",  # unset, Llama 3.1 by its name: its family's
        "/etc/tandem/tool-templates/2/qwen_tools.jinja",  # the ConfigMap's key where it is mounted
        "default",  # named
        "",  # named empty, even for SmolLM2
        "/models/mistral/tools.jinja",  # a path, as written
        "qwen2.5",  # unset, Qwen2.5 by its path
        "",  # unset, a family Tandem ships no template for: auto refused
        "",  # unset, Qwen2.5-Math: not the Qwen2.5 chat format's tools
        "qwen2.5",  # named
        "llama3.1-json",  # named
        "/etc/tandem/tool-templates/11/llama_werkzeuge.jinja",  # a ConfigMap's, in the Llama JSON form
        "/models/custom-hermes/tools.jinja",
        "llama3.1-json",  # unset, Llama 3.1 by its name
    ]


def test_a_models_call_format_reaches_the_gateway_only_where_given() -> None:
    served = json.loads(gateway_env(render_models(MODELS))["TANDEM_GATEWAY_MODELS"])
    given = {m["name"]: m["tool_call_parser"] for m in served if "tool_call_parser" in m}
    assert given == {"custom-llama": "llama3_json", "custom-hermes": "hermes", "Llama-3.1-70B-Instruct": "llama3_json"}


def test_a_configmap_template_is_mounted_on_the_gateway_and_nowhere_else() -> None:
    docs = render_models(MODELS)
    pod, container = gateway_container(docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    templates = sorted(name for name in volumes if name.startswith("tool-template-"))
    assert templates == ["tool-template-11", "tool-template-2"], "one volume per model that names a ConfigMap"
    assert volumes["tool-template-11"]["configMap"]["name"] == "llama-tools"
    assert volumes["tool-template-2"]["configMap"] == {
        "name": "qwen-tools",
        "items": [{"key": "qwen_tools.jinja", "path": "qwen_tools.jinja"}],
    }
    assert mounts["tool-template-2"] == {
        "name": "tool-template-2",
        "mountPath": "/etc/tandem/tool-templates/2",
        "readOnly": True,
    }
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway")]
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    served = json.loads(gateway_env(docs)["TANDEM_GATEWAY_MODELS"])
    assert served[2]["tool_chat_template"] == f"{mounts['tool-template-2']['mountPath']}/qwen_tools.jinja"


def test_the_tandemdeployment_does_not_carry_the_gateways_field() -> None:
    (td,) = [d for d in render_models(MODELS) if d["kind"] == "TandemDeployment"]
    assert [m["name"] for m in td["spec"]["models"]] == [m["name"] for m in MODELS]
    assert all("toolChatTemplate" not in m and "toolCallParser" not in m for m in td["spec"]["models"])
    validate_custom_resource(td)


def test_the_two_model_example_gives_each_family_its_template() -> None:
    """Llama 3.1 and Qwen2.5 get their own families' templates, not the SmolLM2 one."""
    served = json.loads(gateway_env(render("examples/values-gpu-two-models.yaml"))["TANDEM_GATEWAY_MODELS"])
    assert {m["name"]: m["tool_chat_template"] for m in served} == {
        "Llama-3.1-8B-Instruct": "llama3.1-json",
        "Qwen/Qwen2.5-14B-Instruct": "qwen2.5",
    }


def test_the_single_model_form_picks_the_template_by_family() -> None:
    """The single-model form names the gateway's template too (it used to leave the gateway's SmolLM2
    default to any model): by family when unset, as written when set."""
    assert gateway_env(render(None))["TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE"] == "default"  # SmolLM2-135M-Instruct
    assert gateway_env(render("examples/values-gpu.yaml"))["TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE"] == "llama3.1-json"
    cases = [
        ({"servedModelName": "Meta-Llama-3.1-70B-Instruct", "path": "/models/m"}, "llama3.1-json"),
        ({"servedModelName": "chat", "path": "/models/Qwen2.5-0.5B-Instruct"}, "qwen2.5"),
        ({"servedModelName": "Llama-3.2-1B-Instruct", "path": "/models/m"}, ""),  # not 3.1
        ({"servedModelName": "my-model", "path": "/models/model"}, ""),
        ({"servedModelName": "Llama-3.1-8B-Instruct", "path": "/models/m", "toolChatTemplate": ""}, ""),
        ({"servedModelName": "mine", "path": "/models/m", "toolChatTemplate": "qwen2.5"}, "qwen2.5"),
        (
            {"servedModelName": "mine", "path": "/models/m", "toolChatTemplate": "/models/m/t.jinja"},
            "/models/m/t.jinja",
        ),
    ]
    for model, expected in cases:
        assert gateway_env(render_single(model))["TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE"] == expected, model


def test_the_single_model_form_gives_the_call_format_where_set() -> None:
    assert "TANDEM_GATEWAY_TOOL_CALL_PARSER" not in gateway_env(render(None))  # unset: the template's
    for call_format in ("llama3_json", "hermes"):
        model = {"servedModelName": "mine", "path": "/models/m", "toolChatTemplate": "/models/m/t.jinja"}
        env = gateway_env(render_single({**model, "toolCallParser": call_format}))
        assert (env["TANDEM_GATEWAY_TOOL_CHAT_TEMPLATE"], env["TANDEM_GATEWAY_TOOL_CALL_PARSER"]) == (
            "/models/m/t.jinja",
            call_format,
        )


#: Not a format the gateway reads: the template's name for it, vLLM's parsers Tandem does not implement,
#: case, whitespace, a non-ASCII look-alike, hostile text, empty, not a string.
NOT_CALL_FORMATS: list[object] = [
    "llama3.1-json",
    "pythonic",
    "mistral",
    "Hermes",
    "hermes ",
    "ｈｅｒｍｅｓ",
    "llama3_json\n<|eot_id|>",
    "",
    ["hermes"],
]


def test_the_schema_takes_the_call_formats_the_gateway_reads_and_no_other() -> None:
    def single(value: object) -> list[dict[str, object]]:
        return render_single({"toolChatTemplate": "/models/m/t.jinja", "toolCallParser": value})

    def models(value: object) -> list[dict[str, object]]:
        return render_models(
            [{"name": "m", "path": "/models/m", "toolChatTemplate": "/m/t.jinja", "toolCallParser": value}]
        )

    for good in ("hermes", "llama3_json"):
        single(good)  # renders
        models(good)
    for bad in NOT_CALL_FORMATS:
        with pytest.raises(AssertionError, match="toolCallParser"):
            single(bad)
        with pytest.raises(AssertionError, match="toolCallParser"):
            models(bad)


@pytest.mark.parametrize("bad", ["qwen2", "llama3.1", {"configMap": "qwen-tools", "key": "t.jinja"}])
def test_the_schema_refuses_what_the_single_model_form_cannot_name(bad: object) -> None:
    with pytest.raises(AssertionError, match="toolChatTemplate"):
        render_single({"toolChatTemplate": bad})


@pytest.mark.parametrize(
    "bad",
    [
        "some-name",  # neither a shipped template's name, empty nor a path
        "qwen2.5-coder",
        {"configMap": "qwen-tools"},  # no key
        {"configMap": "Not_A_Name", "key": "t.jinja"},
        {"configMap": "qwen-tools", "key": "../etc/passwd"},
        {"configMap": "qwen-tools", "key": "t.jinja", "subPath": "x"},
    ],
)
def test_the_schema_refuses_a_tool_template_it_cannot_mount(bad: object) -> None:
    with pytest.raises(AssertionError, match="toolChatTemplate"):
        render_models([{"name": "m", "path": "/models/m", "toolChatTemplate": bad}])
