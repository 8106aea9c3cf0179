"""Gateway settings, read once by :mod:`tandem.gateway.__main__` from
environment variables prefixed ``TANDEM_GATEWAY_`` (groups nested with
``__``, e.g. ``TANDEM_GATEWAY_REDIS__URL``) and passed down to the app."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.common.settings import RedisSettings, RegistrySettings


def _default_model_dir() -> Path:
    return Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"


class GatewaySettings(BaseSettings):
    """Everything the gateway process needs; one instance per process."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_GATEWAY_", env_nested_delimiter="__", extra="ignore")

    #: Interface the HTTP server binds to.
    host: str = "0.0.0.0"
    #: HTTP port.
    port: int = Field(8080, ge=0, le=65535)
    #: Model name clients pass in ``model`` and see in ``/v1/models``.
    served_model_name: str = "SmolLM2-135M-Instruct"
    #: Hugging Face model folder; only its tokenizer and chat template are loaded.
    model_dir: Path = Field(default_factory=_default_model_dir)
    #: Prompt plus generated tokens may not exceed this.
    max_model_len: int = Field(4096, ge=2)
    #: ``max_tokens`` when the client sends none (capped by the remaining context).
    default_max_tokens: int = Field(256, ge=1)
    #: Largest request body accepted; larger ones get 413.
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)

    #: host:port of the router's gRPC endpoint (Ray Serve gRPC proxy).
    router_address: str = "127.0.0.1:9000"
    #: Deadline of one Schedule or Release call.
    router_timeout_s: float = Field(10.0, gt=0)
    #: Deadline of one Prefill call (queueing + prefill + first token).
    prefill_timeout_s: float = Field(120.0, gt=0)
    #: Deadline of a whole request, prefill through the last decoded token.
    request_timeout_s: float = Field(600.0, gt=0)
    #: Deadline of the best-effort cleanup calls (Abort, Release).
    cleanup_timeout_s: float = Field(2.0, gt=0)
    #: How long a /readyz answer is reused before the router and registry are asked again.
    readiness_cache_s: float = Field(2.0, ge=0)
    #: Deadline of each readiness check (router connect, registry read).
    readiness_timeout_s: float = Field(1.0, gt=0)

    redis: RedisSettings = Field(default_factory=RedisSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)

    #: Log level of the root logger.
    log_level: str = "INFO"
    #: JSON log lines (false: plain text, for humans at a terminal).
    json_logs: bool = True
