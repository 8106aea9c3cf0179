"""Who may do what in Redis: one ACL user per component, least privilege.

The one source of truth for the Redis rights of every Tandem component. Read by
the local stack (:mod:`tandem.local.redis_users`, which creates the users with
``ACL SETUSER`` on start) and by the tests, which check the chart's ACL file
against it (``tandem.redisAclFile`` in ``charts/tandem/templates/_helpers.tpl``,
``tests/chart/test_redis_acl.py``). The rights themselves are proven by
``tests/unit/{common,gateway,router}/test_redis_acl.py``, which run each
component's real Redis code under its own user and what it must be refused.

Without users, whoever reaches Redis is root of the platform: one SET of a key
hash mints an API key, one SET of a worker record makes a fake worker that then
receives prompts. With them:

=========  =====================================================================
user       may
=========  =====================================================================
gateway    read API keys and tenants; read worker registrations; read and write
           quotas, usage, conversations, the tenants' storage accounts and
           background responses' leases (``<prefix>:gw:{quota,usage,conv,stored,bg}:*``); read and write the
           adapter catalog (``<prefix>:adapters``, ``<prefix>:adapters:version``:
           requests resolve adapters through it, the admin API loads them)
router     read worker registrations; its ledger (``<prefix>:router:*``) and its
           pub/sub channel
worker     write worker registrations (it registers itself), read them; read
           the adapter catalog (``<prefix>:adapters``, HGETALL only)
admin      tenants, keys, quotas, usage, conversations (``<prefix>:gw:*``) and
           the adapter catalog: the ``tandem-admin`` CLI, the only writer of keys
           and tenants
operator   the adapter catalog only (``<prefix>:adapters``,
           ``<prefix>:adapters:version``): it reconciles a TandemDeployment's
           adapters into it (HGETALL, HSET, HDEL, INCRBY)
raygcs     the router's Ray head (GCS fault tolerance, KubeRay's
           ``gcsFaultToleranceOptions``): Ray's own tables, the hashes
           ``RAY<prefix>-raygcs@<table>`` of its storage namespace
           (:func:`gcs_storage_namespace`), and nothing of Tandem's
=========  =====================================================================

Nobody but the router publishes on the ledger channel; nobody but the admin
writes a key or a tenant; nobody but a worker writes a registration. Adapters
are written by the admin (CLI), the gateway (admin API) and the operator; a
compromised one of them can point an adapter at other files, which workers load
only if they are a LoRA adapter of their model. Readers of
the registry may ZREM its index (``<prefix>:workers``): they prune the ids whose
record expired (:meth:`tandem.common.registry.WorkerRegistry.list_raw_records`);
at worst a compromised reader hides a live worker until its next heartbeat.

Commands are listed one by one (``+@read``-style categories hold far more than
we use), including those the Lua scripts call: Redis checks a script's commands
and keys against the caller's user. A script's declared ``KEYS`` need read *and*
write rights, so a key a script only reads (a tenant record, for the salt
guard) is passed in ``ARGV``. A new key space or command in the code needs its
line here, or that component gets NOPERM: the unit test above fails first.

What ACLs cannot express: one worker may overwrite another worker's
registration (both are the same user), and the gateway may write any tenant's
usage (it bills every tenant).
"""

from __future__ import annotations

import hashlib
import re

GATEWAY = "gateway"
ROUTER = "router"
WORKER = "worker"
ADMIN = "admin"
OPERATOR = "operator"
RAY_GCS = "raygcs"
#: Every component with a Redis user, in the order of the docs' table.
COMPONENTS = (GATEWAY, ROUTER, WORKER, ADMIN, OPERATOR, RAY_GCS)

#: What a key prefix may hold: it goes into glob patterns and user names unquoted.
_PREFIX = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

#: Every client: PING, and SELECT of the URL's db. (redis-py also sends CLIENT SETINFO, which Redis
#: 7.0 does not know and redis-py's handshake ignores when refused.)
_CONNECTION = ("+ping", "+select")

#: Redis-py runs a registered script with EVALSHA and loads it once on NOSCRIPT.
_SCRIPTS = ("+evalsha", "+script|load")

#: Reading the registry (WorkerRegistry.list_raw_records, .removals): the index, the records, the
#: removals counter, and pruning the index.
_REGISTRY_READ = ("+zrange", "+mget", "+get")


def _registry_read_keys(p: str) -> tuple[str, ...]:
    # Read-only root rights on the records, the index and the removals counter; ZREM on the index
    # alone, in a selector.
    return (f"%R~{p}:worker:*", f"%R~{p}:workers", f"%R~{p}:workers:removed", f"(~{p}:workers +zrem)")


#: The adapter catalog (tandem.common.adapters.AdapterCatalog: entries, put, remove): its hash and its
#: version counter.
_CATALOG_COMMANDS = ("+hgetall", "+hset", "+hdel", "+incrby")  # redis-py sends INCR as INCRBY


def _catalog_keys(p: str) -> tuple[str, ...]:
    return (f"~{p}:adapters", f"~{p}:adapters:version")


def _catalog_selector(p: str) -> str:
    """The catalog's commands on the catalog's keys alone, for a user with other keys and commands."""
    return f"({' '.join((*_catalog_keys(p), *_CATALOG_COMMANDS))})"


def _gateway(p: str) -> tuple[str, ...]:
    commands = (
        *_CONNECTION,
        *_SCRIPTS,
        *_REGISTRY_READ,
        # tenancy.store.lookup_key; usage and conversations; the scripts' own commands
        "+set", "+del", "+exists", "+expire", "+pexpire", "+time",
        "+ttl", "+hget", "+hgetall", "+hmget", "+hset", "+hdel", "+hincrby",
        "+sadd", "+srem", "+smembers", "+scard",
        "+zadd", "+zrem", "+zcard", "+zcount", "+zrangebyscore", "+zremrangebyscore", "+zremrangebyrank",
        "+lrange", "+rpush", "+ltrim", "+lpop",
        # the conversation scripts' whole-exchange trim; a background response's conditional replace
        "+llen", "+lindex", "+rpop",
        "+multi", "+exec", "+discard",
    )  # fmt: skip
    keys = (
        f"%R~{p}:gw:key:*",
        f"%R~{p}:gw:tenant:*",
        f"~{p}:gw:quota:*",
        f"~{p}:gw:usage:*",
        # conversations, stored responses and a streamed background response's events
        # (tandem.gateway.api.response_events: its list is <conv key>:events, written by a script)
        f"~{p}:gw:conv:*",
        f"~{p}:gw:stored:*",
        # background responses' leases and cancel flags (tandem.gateway.api.background_responses)
        f"~{p}:gw:bg:*",
    )
    # The adapter catalog: resolving requests' models, and the admin API's adapter endpoints.
    return (*commands, *keys, *_registry_read_keys(p), _catalog_selector(p))


def _router(p: str) -> tuple[str, ...]:
    commands = (
        *_CONNECTION,
        *_REGISTRY_READ,
        # ledger.Ledger.tick / leave; pubsub.Publisher / Subscription
        "+set", "+del", "+zadd", "+zrem",
        "+publish", "+subscribe", "+unsubscribe",
    )  # fmt: skip
    return (*commands, f"~{p}:router:*", f"&{p}:router:ledger", *_registry_read_keys(p))


def _worker(p: str) -> tuple[str, ...]:
    # registry.WorkerRegistry.heartbeat / unregister (MULTI ... EXEC; an unregister counts itself, which
    # redis-py sends as INCRBY), and reading the others.
    # The adapter catalog: AdapterCatalog.entries (tandem.worker.adapters), read-only.
    commands = (
        *_CONNECTION, *_REGISTRY_READ, "+set", "+del", "+zadd", "+zrem", "+incrby", "+multi", "+exec", "+discard",
        "+hgetall",
    )  # fmt: skip
    return (*commands, f"~{p}:worker:*", f"~{p}:workers", f"~{p}:workers:removed", f"%R~{p}:adapters")


def _admin(p: str) -> tuple[str, ...]:
    # tenancy.store.TenantStore (salting a legacy record: WATCH ... MULTI ... EXEC; a tenant's deletion
    # finds its keys with SCAN), usage.UsageStore's readers, and a tenant's stored bytes
    # (conversations.ConversationStore.stored: a script that forgets the expired conversations first).
    commands = (
        *_CONNECTION,
        *_SCRIPTS,
        "+get", "+set", "+mget", "+del", "+scan", "+time",
        "+sadd", "+srem", "+smembers", "+hget", "+hgetall", "+hdel", "+hincrby",
        "+zcard", "+zrem", "+zrangebyscore",
        "+watch", "+unwatch", "+multi", "+exec", "+discard",
    )  # fmt: skip
    # tandem-admin adapter load / list / unload.
    return (*commands, f"~{p}:gw:*", _catalog_selector(p))


def _operator(p: str) -> tuple[str, ...]:
    # tandem_operator.adapters: AdapterCatalog.entries / put / remove, nothing else.
    return (*_CONNECTION, *_CATALOG_COMMANDS, *_catalog_keys(p))


def gcs_storage_namespace(key_prefix: str) -> str:
    """The Ray head's storage namespace in Redis (KubeRay's ``externalStorageNamespace``, Ray's
    ``RAY_external_storage_namespace``): Ray keeps each GCS table in the hash ``RAY<namespace>@<table>``."""
    return f"{check_prefix(key_prefix)}-raygcs"


#: What Ray 2.60's GCS sends to its Redis (read with MONITOR from a head started with RAY_REDIS_ADDRESS,
#: over a Serve deployment and head restarts): its tables are hashes; INCRBY is the job counter;
#: INFO (CLUSTER, SENTINEL) and DEL of the key DUMMY probe what kind of Redis it is; SCAN (with DEL) is
#: how KubeRay's cleanup job deletes a deleted cluster's keys.
_RAY_GCS_COMMANDS = (
    "+info", "+hset", "+hsetnx", "+hget", "+hmget", "+hkeys", "+hexists", "+hdel", "+hscan",
    "+del", "+exists", "+incrby", "+scan",
)  # fmt: skip


def _ray_gcs(p: str) -> tuple[str, ...]:
    # DEL of DUMMY alone, in a selector: the one key outside its namespace, which it never writes.
    return (*_CONNECTION, *_RAY_GCS_COMMANDS, f"~RAY{gcs_storage_namespace(p)}@*", "(~DUMMY +del)")


_RULES = {
    GATEWAY: _gateway,
    ROUTER: _router,
    WORKER: _worker,
    ADMIN: _admin,
    OPERATOR: _operator,
    RAY_GCS: _ray_gcs,
}


def check_prefix(key_prefix: str) -> str:
    """``key_prefix`` when it can go into ACL patterns and user names as is; ValueError otherwise."""
    if not _PREFIX.fullmatch(key_prefix):
        raise ValueError(f"key prefix {key_prefix!r}: use 1-64 of A-Z a-z 0-9 _ . - (it goes into Redis ACL rules)")
    return key_prefix


def username(component: str, key_prefix: str) -> str:
    """The component's Redis user: ``<prefix>-<component>`` (``tandem-gateway``)."""
    if component not in _RULES:
        raise ValueError(f"no Redis user for {component!r}; components: {', '.join(COMPONENTS)}")
    return f"{check_prefix(key_prefix)}-{component}"


def rules(component: str, key_prefix: str) -> list[str]:
    """The component's ACL rules, after a ``reset`` (no password, no rights, user off)."""
    username(component, key_prefix)  # validates both
    return ["resetchannels", *_RULES[component](key_prefix)]


def setuser_args(component: str, key_prefix: str, password: str) -> list[str]:
    """Arguments of ``ACL SETUSER``: the user from scratch, on, with this password and its rules."""
    return [username(component, key_prefix), "reset", "on", f">{password}", *rules(component, key_prefix)]


def acl_file_line(component: str, key_prefix: str, password: str) -> str:
    """The user as a line of a Redis ACL file (``aclfile``): the password as its SHA-256 only."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return " ".join(["user", username(component, key_prefix), "on", f"#{digest}", *rules(component, key_prefix)])
