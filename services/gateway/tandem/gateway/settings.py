"""Gateway settings, read once by :mod:`tandem.gateway.__main__` from
environment variables prefixed ``TANDEM_GATEWAY_`` (groups nested with
``__``, e.g. ``TANDEM_GATEWAY_REDIS__URL``) and passed down to the app."""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.common.registry import MODEL_NAME
from tandem.common.settings import RedisSettings, RegistrySettings
from tandem.common.tls import TLSSettings
from tandem.gateway.api.tools import ToolCallFormat
from tandem.gateway.storage_quota import DEFAULT_MAX_STORED_BYTES


def _default_model_dir() -> Path:
    return Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"


_TEMPLATES = Path(__file__).parent / "templates"
#: Tandem's tool chat template for the default model (SmolLM2-135M-Instruct, ChatML; Hermes-style calls).
SMOLLM2_TOOL_TEMPLATE = _TEMPLATES / "smollm2_tools.jinja"
#: The Qwen2.5 Instruct family's own tool chat template (Hermes-style calls).
QWEN25_TOOL_TEMPLATE = _TEMPLATES / "qwen2_5_tools.jinja"
#: vLLM's Llama 3.1 template with JSON tool calls (``{"name": ..., "parameters": {...}}``, vLLM's llama3_json).
LLAMA31_JSON_TOOL_TEMPLATE = _TEMPLATES / "llama3_1_json_tools.jinja"

#: The tool chat templates Tandem ships, by the name a setting gives them (the chart's
#: ``toolChatTemplate``, which picks one by the model's family when unset: charts/tandem/templates/_helpers.tpl),
#: and the tool-call format each template asks the model to answer in (tandem.gateway.api.hermes_tools).
NAMED_TOOL_TEMPLATES: dict[str, tuple[Path, ToolCallFormat]] = {
    "default": (SMOLLM2_TOOL_TEMPLATE, "hermes"),
    "qwen2.5": (QWEN25_TOOL_TEMPLATE, "hermes"),
    "llama3.1-json": (LLAMA31_JSON_TOOL_TEMPLATE, "llama3_json"),
}


def tool_template_path(value: object) -> object:
    """A tool chat template setting as written (an environment variable, the chart's JSON): ``""`` is none
    (``tool_choice: "auto"`` refused), a name of :data:`NAMED_TOOL_TEMPLATES` (``"default"``: Tandem's
    template for the SmolLM2 family) that shipped template, else a path."""
    if value == "":
        return None
    if isinstance(value, str) and value in NAMED_TOOL_TEMPLATES:
        return NAMED_TOOL_TEMPLATES[value][0]
    return value


def tool_call_format(template: Path | None, given: ToolCallFormat | None = None) -> ToolCallFormat:
    """The tool-call format a model answers in with ``template``, checked once at start: ``given`` (a
    setting) where set, else the named template's, else Hermes-style (the format of every template Tandem
    ships but the Llama JSON one). ValueError where ``given`` cannot be right: a shipped template asks the
    model for its own format in its text, so another format would read none of its calls; and without a
    template ``tool_choice: "auto"`` is refused, so a format would only hide a missing template."""
    for name, (path, own) in NAMED_TOOL_TEMPLATES.items():
        if template == path:
            if given is not None and given != own:
                raise ValueError(
                    f"tool call format {given!r} disagrees with the tool chat template {name!r}, which asks the"
                    f" model for {own!r} calls: leave the format unset (or give {own!r}), or give a template"
                    " file written for that format"
                )
            return own
    if template is None and given is not None:
        raise ValueError(
            f"tool call format {given!r} is set but the model has no tool chat template, so tool_choice"
            ' "auto" is refused for it: give a tool chat template too, or leave the format unset'
        )
    return given or "hermes"


def served_model_name(value: str) -> str:
    """``value`` if it is a name workers can register (:data:`tandem.common.registry.MODEL_NAME`, the CRD's
    and the chart's rule), else ValueError: a gateway serving any other name would never find a worker."""
    if not MODEL_NAME.fullmatch(value):
        raise ValueError(
            f"model name {value[:60]!r} is not one workers can register: it must match {MODEL_NAME.pattern}"
            " (ASCII letters, digits and _ . / : -, starting with a letter or digit, at most 128 characters)"
        )
    return value


class ServedModel(BaseModel):
    """One base model this gateway serves: its name (a request's ``model``, the router's and the workers'
    model), the folder of its tokenizer and chat template, and its context length."""

    #: Must match tandem.common.registry.MODEL_NAME, as the workers' registered model does.
    name: str
    #: Hugging Face model folder; only its tokenizer and chat template are loaded.
    model_dir: Path
    #: Prompt plus generated tokens may not exceed this.
    max_model_len: int = Field(4096, ge=2)
    #: A chat template (a Jinja file) that presents tools and lets the model answer with tool calls in the
    #: format of tool_call_format; requests with tools and ``tool_choice: "auto"`` are rendered with it (all
    #: others with the model's own template) and their answers read by tandem.gateway.api.hermes_tools.
    #: None: ``auto`` is refused with 400 for this model. Read from JSON (TANDEM_GATEWAY_MODELS, the chart's
    #: ``models[].toolChatTemplate``): a name of NAMED_TOOL_TEMPLATES (``"default"``: Tandem's template for
    #: the SmolLM2 family; ``"qwen2.5"``; ``"llama3.1-json"``) is that shipped file, ``""`` is None, else a
    #: file's path.
    tool_chat_template: Path | None = None
    #: The format the model writes tool calls in with tool_chat_template, which the answers of ``auto``
    #: requests are read in (tandem.gateway.api.hermes_tools), by vLLM's name for its parser of that format
    #: (``--tool-call-parser``): ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>`` blocks) or
    #: ``llama3_json`` (the whole answer ``{"name", "parameters"}``, ``;`` between calls). Unset: the named
    #: template's format, else ``hermes`` (tool_call_format). One that disagrees with a named template's,
    #: or one given without a template, is refused at start (the module's tool_call_format()).
    tool_call_parser: ToolCallFormat | None = None

    @property
    def tool_call_format(self) -> ToolCallFormat:
        """The format this model's tool calls are read in: tool_call_parser, else its template's."""
        return tool_call_format(self.tool_chat_template, self.tool_call_parser)

    @field_validator("name")
    @classmethod
    def _registrable_name(cls, value: str) -> str:
        return served_model_name(value)

    @field_validator("tool_chat_template", mode="before")
    @classmethod
    def _named_template(cls, value: object) -> object:
        return tool_template_path(value)

    @model_validator(mode="after")
    def _agreeing_tool_call_parser(self) -> ServedModel:
        try:
            tool_call_format(self.tool_chat_template, self.tool_call_parser)
        except ValueError as exc:
            raise ValueError(f"model {self.name!r}: {exc}") from None
        return self


class AuthSettings(BaseModel):
    """Who may call the gateway (see docs/tenancy.md)."""

    #: ``api_key``: every request needs a tenant's key (``Authorization: Bearer …``); the default, and what
    #: the chart runs. ``disabled``: every request is the anonymous tenant below (a laptop, a test); the
    #: gateway logs a warning at start.
    mode: Literal["api_key", "disabled"] = "api_key"
    #: Credential of the admin endpoints (``/v1/admin/…``); unset: they answer 403.
    admin_key: SecretStr | None = None
    #: How long a key → tenant lookup is reused in this process; a revoked key stops working after at most
    #: this long (0: ask Redis on every request).
    cache_s: float = Field(2.0, ge=0)
    #: Requests of one key that the gateway may refuse for their own fault (400, 403, 413; not a 404 for a
    #: model or adapter not loaded yet) in a minute; past it, the key's requests get 429 before their body is
    #: read (0: no limit). See tandem.gateway.tenancy.rejections.
    max_rejected_requests_per_minute: int = Field(120, ge=0)


class TenancySettings(BaseModel):
    """Where tenants, keys, quotas, usage and conversations live in Redis."""

    #: Key prefix in Redis; several stacks may share one Redis.
    key_prefix: str = "tandem"
    #: Deadline of one Redis round trip on the request path; past it Redis counts as down.
    redis_timeout_s: float = Field(0.5, gt=0)
    #: Redis down: ``closed`` answers 503 (the default: quotas cannot be overspent); ``open`` serves
    #: tenants already authenticated (cached) without quota checks.
    fail_mode: Literal["closed", "open"] = "closed"
    #: How long a stored conversation lives after its last turn.
    conversation_ttl_s: int = Field(7 * 24 * 3600, ge=60)
    #: Most messages kept per conversation (oldest dropped first).
    max_conversation_messages: int = Field(200, ge=2)
    #: Most conversations kept per tenant; the least recently used are deleted first.
    max_conversations_per_tenant: int = Field(1000, ge=1)
    #: Bytes a tenant may keep stored (conversations) unless its policy sets ``max_stored_bytes``; past it its
    #: least recently used conversations go first (tandem.gateway.storage_quota). 16 MiB: the conversation
    #: cap above times a full 4k-token context of text (~16 KB). Tenants' quotas together should stay below
    #: Redis's ``maxmemory`` (the chart's 200 MB: ~9 tenants at this default), see docs/tenancy.md.
    default_max_stored_bytes_per_tenant: int = Field(DEFAULT_MAX_STORED_BYTES, ge=0)
    #: A gateway replica that has not renewed its liveness for this long is dead: another replica (or its
    #: successor) bills the requests it had in flight, with the tokens they had generated.
    usage_liveness_s: float = Field(30.0, ge=1)
    #: How often each replica looks for dead replicas' open usage records.
    usage_sweep_interval_s: float = Field(10.0, gt=0)
    #: A streaming request's open usage record is written at most this often, off the token path.
    usage_progress_interval_s: float = Field(0.2, gt=0)
    #: Tokens a stream may send beyond what its open record holds before it waits for the record (what a
    #: gateway killed during a Redis stall can leave unbilled, per request).
    usage_max_unsaved_tokens: int = Field(256, ge=0)
    #: A background response (``/v1/responses`` with ``background: true``) whose generating gateway has not
    #: renewed its lease for this long reads as failed; the lease is renewed, and a cancel from another
    #: replica seen, every quarter of it (tandem.gateway.api.background_responses).
    background_lease_s: float = Field(10.0, ge=0.2)


class StreamSettings(BaseModel):
    """SSE behaviour on real networks."""

    #: A streamed request still waiting for its first token after this long commits to 200 and sends an
    #: A heartbeat (blank lines, sse.HEARTBEAT) every this many seconds, so proxies and clients keep the connection.
    heartbeat_interval_s: float = Field(5.0, gt=0)
    #: Bytes of encoded events one stream may hold while the client is not reading.
    max_buffered_bytes: int = Field(256 * 1024, ge=1024)
    #: A stream whose buffer stays full this long is cut off and its generation cancelled.
    slow_reader_timeout_s: float = Field(10.0, gt=0)
    #: SIGTERM: in-flight streams get this long to finish; new requests are refused at once.
    drain_grace_s: float = Field(30.0, ge=0)


class HttpSettings(BaseModel):
    """Limits of the HTTP server itself, before a request reaches a handler (see
    :mod:`tandem.gateway.http_server`). Past one of them the client gets the OpenAI error shape and the
    connection is closed."""

    #: A request head (request line and headers) must be complete this long after its first byte (or, on
    #: a new connection, after the connection opened); else 408 (slow-loris).
    header_timeout_s: float = Field(10.0, gt=0)
    #: A request body must be complete this long after its head; else 408.
    body_timeout_s: float = Field(60.0, gt=0)
    #: Largest request head (request line and headers); larger: 431.
    max_header_bytes: int = Field(32 * 1024, ge=1024)
    #: Most header fields in one request; more: 431.
    max_num_headers: int = Field(100, ge=8)
    #: Open connections beyond this get 503 (``too_many_connections``) for each request.
    max_connections: int = Field(1024, ge=1)
    #: An idle keep-alive connection is closed after this long (longer than load balancers' idle timeouts).
    keep_alive_timeout_s: int = Field(75, ge=1)
    #: Kernel send buffer of each connection (``SO_SNDBUF``); unset: the kernel sizes it, up to
    #: ``net.ipv4.tcp_wmem`` (MiBs on loopback). A client that stops reading is only noticed (and cut off
    #: after ``stream.slow_reader_timeout_s``) once this and ``stream.max_buffered_bytes`` are full.
    send_buffer_bytes: int | None = Field(None, ge=4096)


class GatewaySettings(BaseSettings):
    """Everything the gateway process needs; one instance per process."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_GATEWAY_", env_nested_delimiter="__", extra="ignore")

    #: Interface the HTTP server binds to.
    host: str = "0.0.0.0"
    #: HTTP port.
    port: int = Field(8080, ge=0, le=65535)
    #: Serve ``/metrics`` on this port alone, and not on ``port`` (Kubernetes: the NetworkPolicy lets only
    #: Prometheus reach it, while clients reach ``port``). None: ``/metrics`` beside the API on ``port``.
    metrics_port: int | None = Field(None, ge=0, le=65535)
    #: Model name clients pass in ``model`` and see in ``/v1/models``; it must match
    #: tandem.common.registry.MODEL_NAME (ASCII), as the workers' registered model does (unless ``models`` is set).
    served_model_name: str = "SmolLM2-135M-Instruct"
    #: A request naming a LoRA adapter (its ``model``) is resolved through the adapter catalog in Redis as
    #: read at most this long ago (tandem.gateway.adapters): an adapter unloaded with ``tandem-admin adapter
    #: unload`` gets 404 on every gateway within this long (0: read the catalog on every such request).
    adapter_catalog_cache_s: float = Field(1.0, ge=0)
    #: Hugging Face model folder; only its tokenizer and chat template are loaded.
    model_dir: Path = Field(default_factory=_default_model_dir)
    #: Prompt plus generated tokens may not exceed this.
    max_model_len: int = Field(4096, ge=2)
    #: The single model's tool chat template (ServedModel.tool_chat_template): by default Tandem's for
    #: SmolLM2-135M-Instruct (ChatML); set it to another model's template (a name of NAMED_TOOL_TEMPLATES or
    #: a path), or to an empty value to refuse ``tool_choice: "auto"`` (``default``: Tandem's). With
    #: ``models`` set, each model names its own (none by default). The chart picks one by the model's family.
    tool_chat_template: Path | None = SMOLLM2_TOOL_TEMPLATE
    #: The format of the single model's tool calls (ServedModel.tool_call_parser: ``hermes`` or
    #: ``llama3_json``); unset: the named template's, else ``hermes``. Set it for a template file written
    #: for the Llama JSON form. With ``models`` set, each model names its own.
    tool_call_parser: ToolCallFormat | None = None
    #: The date every chat template is given as ``date_string`` (the models' own and their tool chat
    #: templates: as Meta's Llama 3.x templates name it, Tandem's ``llama3.1-json`` among them), written as
    #: those templates write today's (``%d %b %Y``, e.g. ``26 Jul 2024``). Unset (the default): such a
    #: template writes today's date into the system prompt, as Meta intends, so every prompt's text changes
    #: at midnight and the engines' prefix cache misses the first turns of each day; set, the prompt's
    #: prefix is the same every day, and the model believes it is this date (docs/models.md). Templates
    #: that do not read ``date_string`` ignore it.
    chat_template_date: date | None = None
    #: Every base model served, as JSON (``TANDEM_GATEWAY_MODELS='[{"name": "a", "model_dir": "/m/a",
    #: "max_model_len": 4096}, ...]'``); the first is the default (an adapter loaded without a base model
    #: adapts it). Empty (the default): one model, ``served_model_name`` in ``model_dir`` with
    #: ``max_model_len`` (the three settings above, as the chart sets them). Filled in when read; with
    #: ``models`` set, those three are made the first model's.
    models: list[ServedModel] = Field(default_factory=list)
    #: ``max_tokens`` when the client sends none (capped by the remaining context).
    default_max_tokens: int = Field(256, ge=1)
    #: Largest request body accepted; larger ones get 413.
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    #: Largest total of message (or prompt) text in one request, bytes; more gets 400 before the chat
    #: template is rendered or anything is tokenized. 0: 64 bytes per token of max_model_len (no token
    #: is longer; the default lets a client send up to ~16x the context and have it trimmed).
    max_prompt_bytes: int = Field(0, ge=0)

    #: host:port of the router's gRPC endpoint: its TLS front (``tandem.router.tls_front``) when ``tls`` is
    #: enabled, else Ray Serve's gRPC proxy.
    router_address: str = "127.0.0.1:9000"
    #: Deadline of one Schedule or Release call.
    router_timeout_s: float = Field(10.0, gt=0)
    #: A request keeps asking an unreachable router (a replica or the whole router restarting) this long
    #: before it fails with 503 (or a final SSE error event once its stream has started).
    router_unavailable_wait_s: float = Field(20.0, ge=0)
    #: Deadline of one Prefill call (queueing + prefill + first token).
    prefill_timeout_s: float = Field(120.0, gt=0)
    #: Deadline of a whole request, prefill through the last decoded token.
    request_timeout_s: float = Field(600.0, gt=0)
    #: Deadline of the best-effort cleanup calls (Abort, Release) and of PrefetchKV.
    cleanup_timeout_s: float = Field(2.0, gt=0)
    #: Ask the decode worker to start pulling a prompt's KV while its prefill runs (PrefetchKV), so that
    #: the pull is off the path between the first and the second token. On by default: measured both
    #: ways side by side (make bench-kv, ~2.6k-token prompts, one request at a time), it cut the
    #: second-token gap in each of three runs on 2026-12-04's host (p50 460 against 928 ms, 399
    #: against 897, 291 against 359; plain vLLM's ITL 95-133 ms) and was even on an earlier host (394
    #: against 377 ms); make bench-path's ITL p99 was the same either way there (293 against 289 ms).
    #: It costs the decode worker staging memory (bounded by TANDEM_WORKER_KV__PREFETCH_MAX_BYTES) and
    #: a thread per prompt in flight. Off: decode pulls after the prefill.
    kv_prefetch: bool = True
    #: A stream whose decode worker dies mid-stream is resumed on another decode worker, after the tokens
    #: already sent, at most this many times (0: off; the stream ends with an error event instead).
    max_migrations_per_request: int = Field(3, ge=0)
    #: How long a /readyz answer is reused before the router and registry are asked again.
    readiness_cache_s: float = Field(2.0, ge=0)
    #: Deadline of each readiness check (router connect, registry read).
    readiness_timeout_s: float = Field(1.0, gt=0)

    redis: RedisSettings = Field(default_factory=RedisSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    tenancy: TenancySettings = Field(default_factory=TenancySettings)
    stream: StreamSettings = Field(default_factory=StreamSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    #: mTLS of the calls to the workers and the router (``TANDEM_GATEWAY_TLS__ENABLED``, ``__CERT_FILE``,
    #: ``__KEY_FILE``, ``__CA_FILE``), with the gateway's own certificate (role ``gateway``); on in the chart
    #: and the local stack; off: plaintext, fenced by NetworkPolicies only, with a warning at start
    #: (see docs/security.md).
    tls: TLSSettings = Field(default_factory=TLSSettings)

    #: Log level of the root logger.
    log_level: str = "INFO"
    #: JSON log lines (false: plain text, for humans at a terminal).
    json_logs: bool = True

    @field_validator("tool_chat_template", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return tool_template_path(value)

    @model_validator(mode="after")
    def _served_models(self) -> GatewaySettings:
        if not self.models:
            try:
                served_model_name(self.served_model_name)
            except ValueError as exc:
                raise ValueError(f"served_model_name (TANDEM_GATEWAY_SERVED_MODEL_NAME): {exc}") from None
            try:
                tool_call_format(self.tool_chat_template, self.tool_call_parser)
            except ValueError as exc:
                raise ValueError(f"tool_call_parser (TANDEM_GATEWAY_TOOL_CALL_PARSER): {exc}") from None
            self.models = [
                ServedModel(
                    name=self.served_model_name,
                    model_dir=self.model_dir,
                    max_model_len=self.max_model_len,
                    tool_chat_template=self.tool_chat_template,
                    tool_call_parser=self.tool_call_parser,
                )
            ]
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"models: each served model needs its own name, got {names}")
        # The single-model settings name the default model, for readers that know only one.
        first = self.models[0]
        self.served_model_name, self.model_dir, self.max_model_len = first.name, first.model_dir, first.max_model_len
        return self

    @property
    def default_model(self) -> ServedModel:
        """The first served model."""
        return self.models[0]

    @property
    def chat_template_variables(self) -> dict[str, str]:
        """What every chat template is rendered with beside the messages and tools (HfPromptTokenizer's
        ``template_variables``): ``date_string`` where chat_template_date is set."""
        if self.chat_template_date is None:
            return {}
        # strftime, as transformers' strftime_now writes today's for the template.
        return {"date_string": self.chat_template_date.strftime("%d %b %Y")}
