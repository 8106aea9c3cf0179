"""tenancy.models.allowed and may_know_missing: which base models and LoRA adapters a tenant may
call, and when a name that names nothing may answer 404 (pure functions; the gateway's answers are
in test_tenant_models_http.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tandem.gateway.tenancy.models import Tenant, allowed, may_know_missing

BASE = "SmolLM2-135M-Instruct"
OTHER = "SmolLM2-135M-Instruct-tandem-merged"


def test_no_lists_allow_everything() -> None:
    tenant = Tenant(id="open")
    assert allowed(tenant, BASE, BASE) and allowed(tenant, OTHER, OTHER)
    assert allowed(tenant, "tandem-test-a", BASE)
    assert may_know_missing(tenant, "no-such")


def test_a_model_list_keeps_its_adapters_and_drops_the_other_models() -> None:
    tenant = Tenant(id="narrow", allowed_models=[BASE])
    assert allowed(tenant, BASE, BASE)
    assert not allowed(tenant, OTHER, OTHER)
    assert allowed(tenant, "tandem-test-a", BASE)  # every adapter of an allowed base model
    assert not allowed(tenant, "tandem-test-a", OTHER)  # an adapter does not open its base model
    assert may_know_missing(tenant, "no-such")  # no adapter list: it may list every adapter anyway


def test_an_adapter_list_hides_the_other_adapters() -> None:
    tenant = Tenant(id="lora", allowed_adapters=["tandem-test-a"])
    assert allowed(tenant, "tandem-test-a", BASE)
    assert not allowed(tenant, "tandem-test-b", BASE)
    assert allowed(tenant, BASE, BASE) and allowed(tenant, OTHER, OTHER)  # base models: no list, all
    # A name on no list answers as another tenant's adapter does: 403, never 404.
    assert not may_know_missing(tenant, "tandem-test-b")
    assert not may_know_missing(tenant, "no-such")
    assert may_know_missing(tenant, "tandem-test-a")  # its own, unloaded: 404


def test_both_lists() -> None:
    tenant = Tenant(id="both", allowed_models=[OTHER], allowed_adapters=["tandem-test-a"])
    assert allowed(tenant, OTHER, OTHER) and not allowed(tenant, BASE, BASE)
    assert allowed(tenant, "tandem-test-a", OTHER)
    assert not allowed(tenant, "tandem-test-a", BASE)  # its base model is not allowed
    assert may_know_missing(tenant, OTHER) and not may_know_missing(tenant, BASE)


@pytest.mark.parametrize("name", ["<|im_start|>system", "café", "🦄", "a" * 129, "", "../x", "a b"])
def test_hostile_adapter_names_are_refused_on_the_record(name: str) -> None:
    with pytest.raises(ValidationError, match="not an adapter name"):
        Tenant(id="t", allowed_adapters=[name])


def test_an_old_record_without_the_adapter_list_loads_with_every_adapter() -> None:
    tenant = Tenant.model_validate_json(json.dumps({"id": "old", "allowed_models": [BASE], "salt": "s"}))
    assert tenant.allowed_adapters == [] and allowed(tenant, "tandem-test-c", BASE)
