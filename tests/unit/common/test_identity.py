"""Reading a caller's role from its verified certificate's names (tandem.common.identity), and the
table of who may call what. The servers that apply it are tested with real certificates in
tests/unit/worker/test_caller_roles.py, test_kv_tls.py and tests/unit/router/test_tls_front.py."""

from __future__ import annotations

import pytest

from tandem.common.identity import ALLOWED_ROLES, ROLES, allowed, role_dns_name, role_from_auth_context, role_uri
from tandem.v1 import kv_transfer_pb2, router_pb2, worker_pb2


def _sans(*names: str) -> dict[str, list[bytes]]:
    return {"x509_subject_alternative_name": [n.encode() for n in names]}


@pytest.mark.parametrize("role", ROLES)
def test_the_role_comes_from_the_uri_or_the_dns_name(role: str) -> None:
    assert role_from_auth_context(_sans(role_uri(role), "tandem-internal", "127.0.0.1")) == role
    assert role_from_auth_context(_sans("tandem-internal", role_dns_name(role))) == role  # Helm's genSignedCert
    assert role_from_auth_context(_sans(role_uri(role), role_dns_name(role))) == role  # the local CA: both


def test_no_role_from_a_certificate_that_names_none_two_or_an_unknown_one() -> None:
    assert role_from_auth_context({}) == ""  # plaintext: no certificate at all
    assert role_from_auth_context(_sans("tandem-internal", "localhost")) == ""
    assert role_from_auth_context(_sans(role_uri("decode"), role_dns_name("gateway"))) == ""
    assert role_from_auth_context(_sans("spiffe://tandem/role/admin")) == ""
    assert role_from_auth_context(_sans("spiffe://elsewhere/role/gateway", "gateway.role.tandem.evil")) == ""


def test_every_rpc_of_every_internal_service_has_a_rule_and_a_new_one_is_closed() -> None:
    services = {
        "tandem.v1.Worker": worker_pb2.DESCRIPTOR.services_by_name["Worker"],
        "tandem.v1.KVTransfer": kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"],
        "tandem.v1.Router": router_pb2.DESCRIPTOR.services_by_name["Router"],
    }
    for name, service in services.items():
        for method in service.methods:
            assert f"/{name}/{method.name}" in ALLOWED_ROLES, method.name
    assert not any(allowed("/tandem.v1.Worker/SomethingNew", role) for role in ROLES)


def test_only_gateways_place_prefill_and_decode_and_only_decode_workers_read_kv() -> None:
    for method in ("Prefill", "Decode", "PrefetchKV", "Abort"):
        assert [r for r in ROLES if allowed(f"/tandem.v1.Worker/{method}", r)] == ["gateway"]
    for method in ("Describe", "PullBlockBytes", "StreamBlockBytes", "Release"):
        assert [r for r in ROLES if allowed(f"/tandem.v1.KVTransfer/{method}", r)] == ["decode"]
    for method in ("Schedule", "Release"):
        assert [r for r in ROLES if allowed(f"/tandem.v1.Router/{method}", r)] == ["gateway"]
