"""Admin CLI: ``python -m tandem.gateway.admin`` (or ``tandem-admin``).

Creates, lists, updates and deletes tenants, creates, lists and revokes their
API keys, and shows usage. Talks to the same Redis as the gateways, with the
same settings (``TANDEM_GATEWAY_REDIS__URL``, ``TANDEM_GATEWAY_TENANCY__KEY_PREFIX``).
A new key is printed once and never stored; output is JSON, one object per line.

    tandem-admin tenant create acme --output-tokens-per-minute 20000 --max-concurrent-streams 4
    tandem-admin key create acme --label ci
    tandem-admin key revoke <key id>
    tandem-admin tenant update acme --max-stored-bytes 8388608   # its storage quota
    tandem-admin tenant update acme --allowed-model M --allowed-adapter acme-support   # 403 for the rest
    tandem-admin tenant update acme --all-models --all-adapters  # the allow-lists cleared: everything
    tandem-admin tenant update acme --model-quotas '{"acme-support": {"output_tokens_per_minute": 5000}}'
    tandem-admin tenant show acme       # with "storage": {"stored_bytes", "max_stored_bytes", …}
    tandem-admin usage acme

And loads, lists and unloads LoRA adapters (:mod:`tandem.gateway.adapter_admin`; the catalog sits
under ``TANDEM_GATEWAY_REGISTRY__KEY_PREFIX``, beside the worker registry):

    tandem-admin adapter load acme-support /models/adapters/acme-support [--base-model M]
    tandem-admin adapter list
    tandem-admin adapter unload acme-support
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoPermissionError

from tandem.common.adapters import AdapterCatalog
from tandem.common.errors import BackendUnavailableError, InvalidRequestError
from tandem.gateway.adapter_admin import AdapterAdmin, entry_view
from tandem.gateway.conversations import ConversationStore
from tandem.gateway.redis_client import connect
from tandem.gateway.settings import GatewaySettings
from tandem.gateway.storage_quota import StorageQuota
from tandem.gateway.tenancy.models import Tenant, TenantPolicy
from tandem.gateway.tenancy.store import TenantError, TenantStore
from tandem.gateway.usage import UsageStore

_POLICY_FLAGS: dict[str, type] = {
    "input_tokens_per_minute": int,
    "output_tokens_per_minute": int,
    "max_concurrent_streams": int,
    "max_context_tokens": int,
    "priority_class": str,
    "system_prompt": str,
}


def _add_policy_flags(parser: argparse.ArgumentParser) -> None:
    for name, kind in _POLICY_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=_help(name))
    parser.add_argument(
        "--allowed-model",
        action="append",
        dest="allowed_models",
        default=None,
        help="a base model this tenant may use (repeat; none: all models)",
    )
    parser.add_argument(
        "--allowed-adapter",
        action="append",
        dest="allowed_adapters",
        default=None,
        help="a LoRA adapter this tenant may use, by the name requests use (repeat; none: every adapter of "
        "a model it may use; an adapter also needs its base model allowed)",
    )
    parser.add_argument(
        "--model-quotas",
        dest="model_quotas",
        type=_json_object,
        default=None,
        help='limits per model or adapter on top of the tenant\'s, as JSON: {"NAME": {"input_tokens_per_minute": N, '
        '"output_tokens_per_minute": N, "max_concurrent_streams": N}, ...} (replaces the set; {}: none)',
    )
    parser.add_argument(
        "--allow-client-system-prompt",
        dest="allow_client_system_prompt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether clients may send their own system messages",
    )
    parser.add_argument(
        "--max-stored-bytes",
        dest="max_stored_bytes",
        type=int,
        default=None,
        help="bytes this tenant may keep stored in Redis (conversations); past it its least recently used "
        "conversations are forgotten, and a conversation that alone would be over it gets 413 "
        "storage_quota_exceeded; 0: no conversations (default: tenancy.default_max_stored_bytes_per_tenant)",
    )
    parser.add_argument(
        "--allow-raw-prompts",
        dest="allow_raw_prompts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether /v1/completions serves raw prompts for a tenant with a system prompt or without "
        "client system messages (a raw prompt skips that policy; default: refused with 403)",
    )


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def _help(name: str) -> str:
    field = TenantPolicy.model_fields[name]
    return (field.description or name.replace("_", " ")) + " (default: unlimited/unset)"


def _policy_changes(args: argparse.Namespace) -> dict[str, Any]:
    names = [
        *_POLICY_FLAGS,
        "allowed_models",
        "allowed_adapters",
        "model_quotas",
        "allow_client_system_prompt",
        "allow_raw_prompts",
        "max_stored_bytes",
    ]
    changes = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    for clear_flag, name in (("all_models", "allowed_models"), ("all_adapters", "allowed_adapters")):
        if getattr(args, clear_flag, False):
            if name in changes:
                raise ValueError(
                    f"--{clear_flag.replace('_', '-')} clears the list that --{name[:-1].replace('_', '-')} sets"
                )
            changes[name] = []
    return changes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem-admin", description="Manage Tandem tenants, API keys and usage.")
    sub = parser.add_subparsers(dest="command", required=True)

    tenant = sub.add_parser("tenant", help="tenants").add_subparsers(dest="action", required=True)
    create = tenant.add_parser("create", help="create (or replace) a tenant")
    create.add_argument("tenant_id")
    create.add_argument("--name", default="")
    _add_policy_flags(create)
    update = tenant.add_parser("update", help="change some of a tenant's settings")
    update.add_argument("tenant_id")
    update.add_argument("--name", default=None)
    update.add_argument("--disabled", action=argparse.BooleanOptionalAction, default=None)
    _add_policy_flags(update)
    update.add_argument("--all-models", action="store_true", help="clear the model allow-list: every model")
    update.add_argument("--all-adapters", action="store_true", help="clear the adapter allow-list: every adapter")
    tenant.add_parser("list", help="list tenants")
    show = tenant.add_parser("show", help="one tenant, its keys and its stored bytes")
    show.add_argument("tenant_id")
    delete = tenant.add_parser("delete", help="delete a tenant and revoke its keys")
    delete.add_argument("tenant_id")

    key = sub.add_parser("key", help="API keys").add_subparsers(dest="action", required=True)
    key_create = key.add_parser("create", help="a new key (printed once)")
    key_create.add_argument("tenant_id")
    key_create.add_argument("--label", default="")
    key_list = key.add_parser("list", help="a tenant's keys (ids only)")
    key_list.add_argument("tenant_id")
    key_revoke = key.add_parser("revoke", help="revoke a key by its id")
    key_revoke.add_argument("key_id")

    usage = sub.add_parser("usage", help="usage per tenant and model")
    usage.add_argument("tenant_id", nargs="?", help="one tenant (default: all)")
    usage.add_argument("--day", default=None, help="one UTC day, YYYY-MM-DD")

    adapter = sub.add_parser("adapter", help="LoRA adapters").add_subparsers(dest="action", required=True)
    load = adapter.add_parser("load", help="load (or reload, as a new version) an adapter")
    load.add_argument("name", help="the adapter's name: what requests put in `model`")
    load.add_argument("path", help="its folder (absolute), readable by every worker of its base model")
    load.add_argument("--base-model", default=None, help="the served model it adapts (default: the first)")
    adapter.add_parser("list", help="loaded adapters")
    unload = adapter.add_parser("unload", help="unload an adapter (running requests finish with it)")
    unload.add_argument("name")
    return parser


async def run(args: argparse.Namespace, settings: GatewaySettings) -> list[dict[str, Any]]:
    client = connect(settings.redis.connection_url(), timeout_s=max(2.0, settings.tenancy.redis_timeout_s))
    if args.command == "adapter":
        try:
            catalog = AdapterCatalog(client, key_prefix=settings.registry.key_prefix)
            return await _adapter_command(args, AdapterAdmin(catalog, tuple(m.name for m in settings.models)))
        finally:
            await client.aclose()
    tenancy = settings.tenancy
    store = TenantStore(client, key_prefix=tenancy.key_prefix)
    storage = _Storage(
        ConversationStore(
            client,
            key_prefix=tenancy.key_prefix,
            ttl_s=tenancy.conversation_ttl_s,
            max_messages=tenancy.max_conversation_messages,
            max_conversations=tenancy.max_conversations_per_tenant,
            default_max_stored_bytes=tenancy.default_max_stored_bytes_per_tenant,
        ),
        StorageQuota(tenancy.default_max_stored_bytes_per_tenant),
    )
    try:
        return await _dispatch(args, store, UsageStore(client, key_prefix=tenancy.key_prefix), storage)
    finally:
        await client.aclose()


@dataclass(frozen=True)
class _Storage:
    """What a tenant keeps stored (its storage account), and its limit."""

    conversations: ConversationStore
    quota: StorageQuota

    async def view(self, tenant: Tenant) -> dict[str, int]:
        num_bytes, num_conversations = await self.conversations.stored(tenant.id)
        return {
            "stored_bytes": num_bytes,
            "max_stored_bytes": self.quota.limit_bytes(tenant),
            "num_conversations": num_conversations,
        }


async def _adapter_command(args: argparse.Namespace, admin: AdapterAdmin) -> list[dict[str, Any]]:
    if args.action == "load":
        return [entry_view(await admin.load(args.name, args.path, args.base_model))]
    if args.action == "list":
        return [entry_view(e) for e in await admin.list()]
    if args.action == "unload":
        await admin.unload(args.name)
        return [{"unloaded": args.name}]
    raise AssertionError(f"unhandled adapter command {args.action}")


async def _dispatch(
    args: argparse.Namespace, store: TenantStore, usage: UsageStore, storage: _Storage
) -> list[dict[str, Any]]:
    if args.command == "tenant":
        if args.action == "create":
            tenant = await store.put_tenant(Tenant(id=args.tenant_id, name=args.name, **_policy_changes(args)))
            return [tenant.public()]
        if args.action == "update":
            changes = _policy_changes(args)
            for name in ("name", "disabled"):
                if getattr(args, name) is not None:
                    changes[name] = getattr(args, name)
            return [(await store.update_tenant(args.tenant_id, **changes)).public()]
        if args.action == "list":
            return [t.public() for t in await store.list_tenants()]
        if args.action == "show":
            found = await store.get_tenant(args.tenant_id)
            if found is None:
                raise TenantError(f"no tenant {args.tenant_id!r}")
            keys = [k.model_dump() for k in await store.list_keys(args.tenant_id)]
            return [{**found.public(), "keys": keys, "storage": await storage.view(found)}]
        if args.action == "delete":
            final_usage = await usage.tenant_usage(args.tenant_id)  # the billing record leaves with the output
            num_keys = await store.delete_tenant(args.tenant_id)
            return [final_usage, {"deleted": args.tenant_id, "num_redis_keys_deleted": num_keys}]
    if args.command == "key":
        if args.action == "create":
            record, key = await store.create_key(args.tenant_id, label=args.label)
            return [{**record.model_dump(), "api_key": key, "note": "shown once; store it now"}]
        if args.action == "list":
            return [k.model_dump() for k in await store.list_keys(args.tenant_id)]
        if args.action == "revoke":
            return [(await store.revoke_key(args.key_id)).model_dump()]
    if args.command == "usage":
        tenant_ids = [args.tenant_id] if args.tenant_id else await usage.tenants()
        return [await usage.tenant_usage(t, day=args.day) for t in tenant_ids]
    raise AssertionError(f"unhandled command {args.command} {getattr(args, 'action', '')}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = GatewaySettings()
    try:
        for item in asyncio.run(run(args, settings)):
            print(json.dumps(item, ensure_ascii=False))
    except (TenantError, ValueError, InvalidRequestError) as exc:
        print(f"tandem-admin: {exc}", file=sys.stderr)
        return 2
    except BackendUnavailableError as exc:
        print(f"tandem-admin: {exc} ({settings.redis.address()})", file=sys.stderr)
        return 3
    except NoPermissionError as exc:
        # Logged in as a component's user (the gateway's may read keys, never write one).
        print(
            f"tandem-admin: Redis refused: {exc}. Log in as the admin user: TANDEM_GATEWAY_REDIS__USERNAME="
            "<prefix>-admin and TANDEM_GATEWAY_REDIS__PASSWORD_FILE (docs/security.md, Redis)",
            file=sys.stderr,
        )
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
