"""Each local component's environment (``TANDEM_<COMPONENT>_*``), from a :class:`StackConfig`, as the
chart sets the same variables on each pod.

Called by :class:`tandem.local.stack.LocalStack` when it starts (and restarts) a component: it passes
what it made at start, each component's Redis login (:mod:`tandem.local.redis_users`) and TLS settings
(:mod:`tandem.local.pki`), and the gateway's admin key."""

from __future__ import annotations

import json
import os

from tandem.common.tls import TLSSettings
from tandem.local.redis_users import RedisLogin
from tandem.local.stack_config import StackConfig


def base_env(config: StackConfig) -> dict[str, str]:
    """This process's environment less its own ``TANDEM_*`` settings, plus the config's ``extra_env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update({"PYTHONUNBUFFERED": "1", **config.extra_env})
    return env


def tls_env(prefix: str, tls: TLSSettings) -> dict[str, str]:
    if not tls.enabled:
        return {f"{prefix}ENABLED": "false"}  # plaintext, said explicitly
    return {f"{prefix}{key.upper()}": str(value) for key, value in tls.to_dict().items() if value is not None}


def redis_env(prefix: str, login: RedisLogin | None) -> dict[str, str]:
    return login.env(prefix) if login is not None else {}


def worker_role(name: str) -> str:
    """The role of the worker component ``name`` (decode, decode-1, decode-m1, ... or a prefill one)."""
    return "decode" if name.startswith("decode") else "prefill"


def worker_env(config: StackConfig, name: str, *, login: RedisLogin | None, tls: TLSSettings) -> dict[str, str]:
    c = config
    role = worker_role(name)
    ports = c.worker_ports()[name]
    model_name, model_dir = c.worker_model(name)
    env = base_env(c)
    env.update(
        {
            "TANDEM_WORKER_ROLE": role,
            "TANDEM_WORKER_BIND_HOST": c.host,
            "TANDEM_WORKER_PORT": str(ports.port),
            "TANDEM_WORKER_METRICS_PORT": str(ports.metrics_port),
            "TANDEM_WORKER_KV__HOST": c.host,
            "TANDEM_WORKER_KV__PORT": str(ports.kv_port),
            "TANDEM_WORKER_KV__LEASE_S": str(c.kv_lease_s),
            "TANDEM_WORKER_KV_EVENTS__PORT": str(ports.kv_events_port),
            "TANDEM_WORKER_KV_EVENTS__REPLAY_PORT": str(ports.kv_events_replay_port),
            "TANDEM_WORKER_ENGINE__MODEL_DIR": str(model_dir),
            "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME": model_name,
            "TANDEM_WORKER_ENGINE__MAX_MODEL_LEN": str(c.max_model_len),
            "TANDEM_WORKER_ENGINE__KV_CACHE_BYTES": str(c.kv_cache_bytes),
            "TANDEM_WORKER_REDIS__URL": c.redis_url,
            "TANDEM_WORKER_REGISTRY__KEY_PREFIX": c.key_prefix,
        }
    )
    if c.kv_shm_dir is not None:
        env["TANDEM_WORKER_KV__SHM_DIR"] = str(c.kv_shm_dir)
    if c.max_adapters:
        env["TANDEM_WORKER_ADAPTERS__MAX_ADAPTERS"] = str(c.max_adapters)
        env["TANDEM_WORKER_ADAPTERS__MAX_ADAPTER_RANK"] = str(c.max_adapter_rank)
    env.update(redis_env("TANDEM_WORKER_", login))
    num_cpus = os.cpu_count() or 1
    if c.pin_engine_cores and num_cpus >= 2:
        # Prefill workers one core each, round the cores; the first decode on the last core
        # (with two cores and two prefill workers it shares core 1 with prefill-1), further
        # decode workers round the cores from the other end (two models on two cores: prefill 0,
        # decode 1, prefill-m1 1, decode-m1 0).
        names = list(c.worker_ports())
        if role == "decode":
            decode_names = [n for n in names if n.startswith("decode")]
            core = num_cpus - 1 - decode_names.index(name) % num_cpus
        else:
            prefill_names = [n for n in names if not n.startswith("decode")]
            core = prefill_names.index(name) % num_cpus
        env["TANDEM_WORKER_ENGINE__CPU_THREADS_BIND"] = str(core)
    env.update(tls_env("TANDEM_WORKER_TLS__", tls))
    return env


def router_env(config: StackConfig, *, login: RedisLogin | None, tls: TLSSettings) -> dict[str, str]:
    c = config
    env = base_env(c)
    env.update(
        {
            "TANDEM_ROUTER_GRPC_PORT": str(c.router_grpc_port),
            "TANDEM_ROUTER_HTTP_PORT": str(c.router_http_port),
            "TANDEM_ROUTER_HTTP_HOST": c.host,
            "TANDEM_ROUTER_REDIS__URL": c.redis_url,
            "TANDEM_ROUTER_REGISTRY__KEY_PREFIX": c.key_prefix,
            "TANDEM_ROUTER_LEDGER__SECRET_FILE": str(c.router_ledger_secret_file),
        }
    )
    env.update(redis_env("TANDEM_ROUTER_", login))
    if c.internal_tls:
        env.update({"TANDEM_ROUTER_TLS_HOST": c.host, "TANDEM_ROUTER_TLS_PORT": str(c.router_tls_port)})
    env.update(tls_env("TANDEM_ROUTER_TLS__", tls))
    if c.router_metrics_port:
        env["TANDEM_ROUTER_METRICS_PORT"] = str(c.router_metrics_port)
    if c.router_policy:
        env["TANDEM_ROUTER_POLICY"] = c.router_policy
    if c.min_uncached_tokens_to_disaggregate is not None:
        env["TANDEM_ROUTER_DISAGGREGATION__MIN_UNCACHED_TOKENS"] = str(c.min_uncached_tokens_to_disaggregate)
    return env


def router_address(config: StackConfig) -> str:
    """What the gateway dials: the router's TLS front, or Serve's proxy when the stack runs plaintext."""
    return f"{config.host}:{config.router_tls_port if config.internal_tls else config.router_grpc_port}"


def gateway_env(config: StackConfig, *, admin_key: str, login: RedisLogin | None, tls: TLSSettings) -> dict[str, str]:
    c = config
    env = base_env(c)
    env.update(
        {
            "TANDEM_GATEWAY_HOST": c.host,
            "TANDEM_GATEWAY_PORT": str(c.gateway_port),
            "TANDEM_GATEWAY_SERVED_MODEL_NAME": c.served_model_name,
            "TANDEM_GATEWAY_MODEL_DIR": str(c.model_dir),
            "TANDEM_GATEWAY_MAX_MODEL_LEN": str(c.max_model_len),
            "TANDEM_GATEWAY_ROUTER_ADDRESS": router_address(c),
            "TANDEM_GATEWAY_REDIS__URL": c.redis_url,
            "TANDEM_GATEWAY_REGISTRY__KEY_PREFIX": c.key_prefix,
            "TANDEM_GATEWAY_TENANCY__KEY_PREFIX": c.key_prefix,
            "TANDEM_GATEWAY_AUTH__MODE": c.auth_mode,
            "TANDEM_GATEWAY_AUTH__ADMIN_KEY": admin_key,
        }
    )
    if c.extra_models:
        models = [{"name": n, "model_dir": str(d), "max_model_len": c.max_model_len} for n, d in c.served_models()]
        env["TANDEM_GATEWAY_MODELS"] = json.dumps(models)
    env.update(redis_env("TANDEM_GATEWAY_", login))
    env.update(tls_env("TANDEM_GATEWAY_TLS__", tls))
    return env
