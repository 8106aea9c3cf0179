"""Every request parameter the gateway knows, and what it does with each.

Called by :mod:`tandem.gateway.api.validation` (``check_parameters``) before
the body is validated; calls nothing. The table is the single source of truth:
``docs/api-parameters.md`` is checked against it by
``tests/unit/gateway/test_parameters_table.py``.

Three kinds:

* **honoured**: validated by :mod:`validation` and carried to the engines of
  both roles (the prefill's first token and decode's continuation; see
  ``tandem.worker.first_token``);
* **refused**: OpenAI or vLLM define it, Tandem does not implement it, so a
  request that sets it gets 400 ``unsupported_parameter`` rather than an
  answer that silently ignores it. Some are refused only away from their
  neutral value (``n: 1`` and ``echo: false`` are fine);
* **metadata**: OpenAI itself defines it as information about the request,
  not about the answer; accepted and not acted on.

A parameter in none of these (a new SDK field, a typo) is accepted and
ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tandem.common.errors import InvalidRequestError

Endpoint = Literal["chat", "completions"]
Kind = Literal["honoured", "refused", "metadata"]
BOTH: tuple[Endpoint, ...] = ("chat", "completions")
CHAT: tuple[Endpoint, ...] = ("chat",)
COMPLETIONS: tuple[Endpoint, ...] = ("completions",)

_MISSING = object()


@dataclass(frozen=True)
class Parameter:
    name: str
    kind: Kind
    endpoints: tuple[Endpoint, ...]
    #: What happens, in one line (also the 400 message for a refused one).
    note: str
    #: Values of a refused parameter that are accepted because they ask for nothing (``None`` always is).
    neutral: tuple[Any, ...] = ()
    #: "openai" or "vllm" (an extension vLLM's OpenAI server accepts).
    origin: str = "openai"


def _honoured(name: str, endpoints: tuple[Endpoint, ...], note: str, origin: str = "openai") -> Parameter:
    return Parameter(name, "honoured", endpoints, note, origin=origin)


def _refused(
    name: str, endpoints: tuple[Endpoint, ...], note: str, neutral: tuple[Any, ...] = (), origin: str = "openai"
) -> Parameter:
    return Parameter(name, "refused", endpoints, note, neutral, origin)


PARAMETERS: tuple[Parameter, ...] = (
    # -- OpenAI, honoured --------------------------------------------------------------------------------
    _honoured("model", BOTH, "must name the served model (404 otherwise) and be allowed for the key"),
    _honoured("messages", CHAT, "rendered with the model's chat template; message text is data, never control"),
    _honoured("prompt", COMPLETIONS, "one string or one list of token ids"),
    _honoured("max_tokens", BOTH, "counts the first token; default fills the context up to the gateway's default"),
    _honoured("max_completion_tokens", CHAT, "newer name of max_tokens; wins when both are sent"),
    _honoured("temperature", BOTH, "0..2; unset takes the model's generation_config.json default"),
    _honoured("top_p", BOTH, "(0, 1]; unset takes the model's default"),
    _honoured("presence_penalty", BOTH, "-2..2"),
    _honoured("frequency_penalty", BOTH, "-2..2"),
    _honoured("seed", BOTH, "same seed, same answer as one colocated vLLM engine (decode replays the first draw)"),
    _honoured("stop", BOTH, "up to 16 strings; a stop string may begin in the prefill's first token"),
    _honoured("stream", BOTH, "Server-Sent Events"),
    _honoured("stream_options", BOTH, "include_usage only; only with stream: true"),
    _honoured("logit_bias", BOTH, "token id → bias in -100..100, applied to every token including the first"),
    _honoured("logprobs", BOTH, "chat: true/false; completions: 0..5 top alternatives"),
    _honoured("top_logprobs", CHAT, "0..20; needs logprobs: true"),
    _honoured("response_format", BOTH, "text, json_object, json_schema: a grammar constrains every token"),
    _honoured("n", BOTH, "only 1"),
    _honoured(
        "tools",
        CHAT,
        "function tools only, at most 128; given to the chat template as vLLM does (see Tools below)",
    ),
    _honoured(
        "tool_choice",
        CHAT,
        "a named function or required: a grammar makes the answer the call's JSON; none; auto: the model's tool "
        "chat template and a Hermes parser (400 for a model without one)",
    ),
    _honoured("parallel_tool_calls", CHAT, "false: required makes at most one call"),
    # -- OpenAI, refused ---------------------------------------------------------------------------------
    _refused("functions", CHAT, "Function calling is not supported for this model.", neutral=([],)),
    _refused("function_call", CHAT, "Function calling is not supported for this model.", neutral=("none",)),
    _refused("audio", CHAT, "Audio output is not supported."),
    _refused("modalities", CHAT, "Only text output is supported.", neutral=(["text"],)),
    _refused("prediction", CHAT, "Predicted outputs are not supported."),
    _refused("reasoning_effort", CHAT, "This model does not reason; reasoning_effort is not supported."),
    _refused("verbosity", CHAT, "verbosity is not supported."),
    _refused("web_search_options", CHAT, "Web search is not supported."),
    _refused("service_tier", BOTH, "Only the default service tier exists.", neutral=("auto", "default")),
    _refused("echo", BOTH, "echo is not supported.", neutral=(False,)),
    _refused("best_of", COMPLETIONS, "Only best_of=1 is supported.", neutral=(1,)),
    _refused("suffix", COMPLETIONS, "suffix (insertion) is not supported.", neutral=("",)),
    # -- OpenAI, metadata --------------------------------------------------------------------------------
    Parameter("user", "metadata", BOTH, "end-user id; accepted, not used"),
    Parameter("metadata", "metadata", BOTH, "key-value tags; accepted, not stored"),
    Parameter("store", "metadata", BOTH, "accepted; Tandem stores no completions for distillation"),
    Parameter("safety_identifier", "metadata", BOTH, "end-user id; accepted, not used"),
    Parameter("prompt_cache_key", "metadata", BOTH, "accepted; prefix caching is automatic, per tenant"),
    # -- vLLM extensions, honoured -----------------------------------------------------------------------
    _honoured("top_k", BOTH, "-1 (off) or ≥ 1; unset takes the model's default", "vllm"),
    _honoured("min_p", BOTH, "0..1; unset takes the model's default", "vllm"),
    _honoured("repetition_penalty", BOTH, "(0, 2]; unset takes the model's default", "vllm"),
    _honoured("min_tokens", BOTH, "no stop token or stop string before this many tokens", "vllm"),
    _honoured("stop_token_ids", BOTH, "token ids that end the answer, the first token included", "vllm"),
    _honoured("include_stop_str_in_output", BOTH, "keep the matched stop string in the text", "vllm"),
    _honoured("ignore_eos", BOTH, "generate max_tokens past end-of-sequence (benchmarks)", "vllm"),
    _honoured("skip_special_tokens", BOTH, "default true, as vLLM", "vllm"),
    _honoured("spaces_between_special_tokens", BOTH, "default true, as vLLM", "vllm"),
    _honoured("structured_outputs", BOTH, "one of json, json_object, regex, choice, grammar", "vllm"),
    _honoured(
        "conversation_id",
        CHAT,
        "Tandem: the server keeps this conversation's turns; a conversation that alone would be over the "
        "tenant's storage quota gets 413 `storage_quota_exceeded` (docs/tenancy.md, Storage quota)",
        "tandem",
    ),
    # -- vLLM extensions, refused ------------------------------------------------------------------------
    _refused("use_beam_search", BOTH, "Beam search is not supported.", neutral=(False,), origin="vllm"),
    _refused(
        "length_penalty", BOTH, "length_penalty applies to beam search, which is not supported.", (1, 1.0), "vllm"
    ),
    _refused("prompt_logprobs", BOTH, "prompt_logprobs are not supported.", origin="vllm"),
    _refused("truncate_prompt_tokens", BOTH, "Use the tenant's context trimming instead.", origin="vllm"),
    _refused("allowed_token_ids", BOTH, "allowed_token_ids is not supported; use logit_bias.", origin="vllm"),
    _refused("bad_words", BOTH, "bad_words is not supported; use logit_bias.", neutral=([],), origin="vllm"),
    _refused("add_generation_prompt", CHAT, "The gateway always adds the generation prompt.", (True,), "vllm"),
    _refused("continue_final_message", CHAT, "continue_final_message is not supported.", (False,), "vllm"),
    _refused("add_special_tokens", BOTH, "add_special_tokens is not supported.", origin="vllm"),
    _refused("documents", CHAT, "documents are not supported.", origin="vllm"),
    _refused("chat_template", CHAT, "The model's own chat template is always used.", origin="vllm"),
    _refused("chat_template_kwargs", CHAT, "chat_template_kwargs are not supported.", origin="vllm"),
    _refused("mm_processor_kwargs", BOTH, "Multimodal input is not supported.", origin="vllm"),
    _refused("priority", BOTH, "Priority comes from the API key's tenant.", origin="vllm"),
    _refused("request_id", BOTH, "The gateway assigns request ids.", origin="vllm"),
    _refused("cache_salt", BOTH, "The cache salt comes from the API key's tenant.", origin="vllm"),
    _refused("kv_transfer_params", BOTH, "KV transfer is internal to Tandem.", origin="vllm"),
    _refused("logits_processors", BOTH, "Custom logits processors are not supported.", origin="vllm"),
    _refused("vllm_xargs", BOTH, "vllm_xargs are not supported.", origin="vllm"),
    _refused("return_tokens_as_token_ids", BOTH, "return_tokens_as_token_ids is not supported.", (False,), "vllm"),
    _refused("return_token_ids", BOTH, "return_token_ids is not supported.", (False,), "vllm"),
    _refused("guided_json", BOTH, "Use response_format or structured_outputs.", origin="vllm"),
    _refused("guided_regex", BOTH, "Use structured_outputs.regex.", origin="vllm"),
    _refused("guided_choice", BOTH, "Use structured_outputs.choice.", origin="vllm"),
    _refused("guided_grammar", BOTH, "Use structured_outputs.grammar.", origin="vllm"),
    _refused("guided_decoding_backend", BOTH, "The structured-output backend is the engine's.", origin="vllm"),
    _refused("structural_tag", BOTH, "structural_tag is not supported.", origin="vllm"),
    _refused("repetition_detection", BOTH, "repetition_detection is not supported.", origin="vllm"),
)

#: Keys of one chat message, and what happens to them.
MESSAGE_FIELDS: tuple[Parameter, ...] = (
    _honoured("role", CHAT, "system, developer (as system), user, assistant, tool"),
    _honoured("content", CHAT, "a string or text parts; other part types are refused"),
    _refused("name", CHAT, "Message names are not supported by this model's chat template."),
    _honoured("tool_calls", CHAT, "an assistant turn's function calls (content may be null), to the chat template"),
    _honoured("tool_call_id", CHAT, "a tool turn's answer to that call; its content is data, as every content"),
    _refused("function_call", CHAT, "Function calling is not supported for this model."),
    _refused("audio", CHAT, "Audio is not supported."),
    _refused("refusal", CHAT, "Assistant refusals cannot be sent back to this model."),
)

_BY_ENDPOINT: dict[Endpoint, dict[str, Parameter]] = {
    endpoint: {p.name: p for p in PARAMETERS if endpoint in p.endpoints} for endpoint in BOTH
}
_REFUSED_MESSAGE_FIELDS = {p.name: p for p in MESSAGE_FIELDS if p.kind == "refused"}


def _is_neutral(parameter: Parameter, value: Any) -> bool:
    return value is None or any(value == n and type(value) is type(n) for n in parameter.neutral)


def check_parameters(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    """400 ``unsupported_parameter`` for the first refused parameter set to something other than neutral."""
    known = _BY_ENDPOINT[endpoint]
    for name, value in body.items():
        parameter = known.get(name)
        if parameter is not None and parameter.kind == "refused" and not _is_neutral(parameter, value):
            raise InvalidRequestError(f"{name}: {parameter.note}", param=name, code="unsupported_parameter")
    messages = body.get("messages") if endpoint == "chat" else None
    if isinstance(messages, list):
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                continue  # the model validation reports it
            for name, value in message.items():
                parameter = _REFUSED_MESSAGE_FIELDS.get(name)
                if parameter is not None and not _is_neutral(parameter, value):
                    param = f"messages.{index}.{name}"
                    raise InvalidRequestError(f"{param}: {parameter.note}", param=param, code="unsupported_parameter")
            if message.get("role") == "function":
                param = f"messages.{index}.role"
                raise InvalidRequestError(
                    f"{param}: the role function (the deprecated functions API) is not supported; use tools.",
                    param=param,
                    code="unsupported_parameter",
                )
