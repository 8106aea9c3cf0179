"""Every name rule is matched whole: Python's ``re`` lets ``$`` match before a final newline, so a
``pattern.match`` took ``"name\\n"`` for ``"name"``. A newline in a tenant id, a conversation or response
id, an adapter or model name, or a Redis key prefix would reach Redis keys, ACL rules, Prometheus
labels and PromQL; each rule refuses it."""

from __future__ import annotations

import pydantic
import pytest
from tandem_operator import pool_spec, spec

from tandem.common import adapters, redis_acl
from tandem.common.errors import InvalidRequestError
from tandem.gateway import adapter_admin, conversations
from tandem.gateway.api import response_chains
from tandem.gateway.tenancy.models import valid_tenant_id


def test_a_tenant_id_with_a_final_newline_is_not_valid() -> None:
    assert valid_tenant_id("acme")
    assert not valid_tenant_id("acme\n")


def test_a_conversation_id_with_a_final_newline_is_refused() -> None:
    conversations.check_conversation_id("conv_1")
    with pytest.raises(InvalidRequestError):
        conversations.check_conversation_id("conv_1\n")


def test_an_adapter_name_with_a_final_newline_is_refused() -> None:
    adapter_admin.check_name("sql-lora", ("base",))
    with pytest.raises(InvalidRequestError):
        adapter_admin.check_name("sql-lora\n", ("base",))
    assert adapters.split_engine_name(adapters.engine_name("sql-lora", 3)) == ("sql-lora", 3)
    with pytest.raises(ValueError, match="not an adapter engine name"):
        adapters.split_engine_name(adapters.engine_name("sql-lora\n", 3))


def test_a_redis_key_prefix_with_a_final_newline_is_refused() -> None:
    assert redis_acl.check_prefix("tandem") == "tandem"
    with pytest.raises(ValueError, match="key prefix"):
        redis_acl.check_prefix("tandem\n")


async def test_a_response_id_with_a_final_newline_is_not_found_before_any_read() -> None:
    class NoStore:
        async def read(self, tenant_id: str, conversation_id: str) -> object:
            raise AssertionError("a malformed id must not reach the store")

    with pytest.raises(InvalidRequestError, match="not found") as caught:
        await response_chains.read_response(NoStore(), "acme", "resp_abc\n")  # type: ignore[arg-type]
    assert caught.value.code == "response_not_found"


def test_the_operator_slugs_and_rollout_counts_are_matched_whole() -> None:
    assert spec.model_slug("smollm2") == "smollm2"
    assert spec.model_slug("smollm2\n") != "smollm2\n"
    assert pool_spec.Rollout(max_surge="25%").max_surge == "25%"
    with pytest.raises(pydantic.ValidationError, match="maxSurge"):
        pool_spec.Rollout(max_surge="25%\n")
