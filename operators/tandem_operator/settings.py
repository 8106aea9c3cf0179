"""Operator settings, read once by :mod:`tandem_operator.handlers` at startup
from the environment (prefix ``TANDEM_OPERATOR_``)."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_OPERATOR_", extra="ignore")

    #: An explicit API server URL (tests against kmock, local development). Unset:
    #: the pod's service account (in a cluster) or kubeconfig (kopf's login).
    api_server_url: str = ""
    #: How often the autoscaling timer wakes up; each resource's
    #: ``autoscaling.intervalSeconds`` decides how often it actually decides.
    tick_s: float = Field(default=1.0, gt=0)
    #: Redis of the adapter catalog (``spec.adapters``); each resource's ``redis.keyPrefix`` picks its
    #: catalog there. "" = adapters are not reconciled (the resource says so in AdaptersReconciled).
    redis_url: str = ""
    #: How often the timer syncs a resource's adapters again (Redis back after an outage, an admin's
    #: unload of a managed adapter undone).
    adapter_resync_s: float = Field(default=30.0, gt=0)
    #: Seconds kopf waits before retrying a reconcile that hit an API error.
    retry_delay_s: float = Field(default=10.0, gt=0)
    kubernetes_service_host: str = Field(
        default="", validation_alias=AliasChoices("KUBERNETES_SERVICE_HOST")
    )
    kubernetes_service_port: str = Field(
        default="443", validation_alias=AliasChoices("KUBERNETES_SERVICE_PORT")
    )
