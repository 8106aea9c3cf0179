"""What the route handlers use, built once by :func:`tandem.gateway.app.build_app` and
kept in ``app.state.services``; holds no logic."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.gateway.adapter_admin import AdapterAdmin
from tandem.gateway.adapters import ModelResolver
from tandem.gateway.api.background_responses import BackgroundResponses
from tandem.gateway.api.generation import StreamLimits
from tandem.gateway.api.tools import ToolCallFormat
from tandem.gateway.conversations import ConversationStore
from tandem.gateway.drain import Drain
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.orchestrator import Orchestrator
from tandem.gateway.prompt import PromptTokenizer
from tandem.gateway.quota.base import Quota
from tandem.gateway.readiness import ReadinessCheck
from tandem.gateway.storage_quota import StorageQuota
from tandem.gateway.tenancy.auth import Authenticator
from tandem.gateway.tenancy.rejections import RejectionLimiter
from tandem.gateway.usage import UsageStore


@dataclass(frozen=True)
class ModelLimits:
    served_model_name: str
    max_model_len: int
    default_max_tokens: int
    max_body_bytes: int
    #: Largest total of message or prompt text, bytes (checked before any rendering or tokenizing).
    max_prompt_bytes: int = 1 << 20


@dataclass(frozen=True)
class ServedModelServices:
    """What one served base model's requests use: its limits, its tokenizer and chat template."""

    limits: ModelLimits
    tokenizer: PromptTokenizer
    #: The tokenizer with the model's tool chat template, for requests with tools and ``tool_choice: "auto"``;
    #: None: the model has none, and ``auto`` is refused (tandem.gateway.api.tools.AUTO_REFUSED).
    tool_tokenizer: PromptTokenizer | None = None
    #: The format of the model's tool calls with that template (tandem.gateway.api.hermes_tools reads it).
    tool_call_format: ToolCallFormat = "hermes"


@dataclass(frozen=True)
class GatewayServices:
    """What the handlers use; built once by :func:`tandem.gateway.app.build_app`."""

    limits: ModelLimits
    tokenizer: PromptTokenizer
    orchestrator: Orchestrator
    readiness: ReadinessCheck
    metrics: GatewayMetrics
    started_unix_s: int
    authenticator: Authenticator
    quota: Quota
    usage: UsageStore
    conversations: ConversationStore
    #: Refused requests per key (429 past the limit, before the body is read).
    rejections: RejectionLimiter
    #: Each tenant's limit on the bytes it keeps stored (conversations).
    storage_quota: StorageQuota
    drain: Drain
    stream_limits: StreamLimits
    #: What a request's ``model`` names: a served model or a LoRA adapter (the catalog, cached).
    models: ModelResolver
    #: Loads and unloads adapters (the admin API).
    adapter_admin: AdapterAdmin
    #: Background responses of the Responses API: their leases, cancels and running generations.
    background: BackgroundResponses
    #: Each served base model's limits and tokenizer, by name (tandem.gateway.settings.ServedModel); a model
    #: missing here (a test's app with one model) uses ``limits`` and ``tokenizer``, the default model's.
    served: Mapping[str, ServedModelServices] = field(default_factory=dict)
    admin_key: str | None = None
    #: The default model's tool tokenizer (ServedModelServices.tool_tokenizer), for a model missing in ``served``.
    tool_tokenizer: PromptTokenizer | None = None
    #: How often a request's open usage record is written as its answer streams, and how far it may lag
    #: the tokens sent before the stream waits for it (tandem.gateway.usage_progress).
    usage_progress_interval_s: float = 0.2
    usage_max_unsaved_tokens: int = 256

    def for_model(self, base_model: str) -> ServedModelServices:
        """The limits and tokenizer of the served base model ``base_model`` (a resolved request's)."""
        served = self.served.get(base_model)
        return served if served is not None else ServedModelServices(self.limits, self.tokenizer, self.tool_tokenizer)
