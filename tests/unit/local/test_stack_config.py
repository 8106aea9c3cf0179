"""LocalStack configuration: several prefill workers, KV-event ports, core pinning (no processes started)."""

from __future__ import annotations

from tandem.local.stack import LocalStack, StackConfig, ensure_ledger_secret
from tandem.router.ledger_auth import read_secret


def test_free_ports_cover_every_worker_and_are_distinct() -> None:
    config = StackConfig.with_free_ports(num_prefill_workers=3)
    workers = config.worker_ports()
    assert list(workers) == ["prefill", "prefill-1", "prefill-2", "decode"]
    ports = [
        p
        for w in workers.values()
        for p in (w.port, w.kv_port, w.metrics_port, w.kv_events_port, w.kv_events_replay_port)
    ]
    assert len(set(ports)) == len(ports)


def test_worker_env_has_kv_event_ports_and_pins_cores(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    config = StackConfig.with_free_ports(num_prefill_workers=2, router_policy="round_robin")
    stack = LocalStack(config)
    env = {name: stack._worker_env(name) for name in config.worker_ports()}
    assert env["prefill-1"]["TANDEM_WORKER_KV_EVENTS__PORT"] == str(config.worker_ports()["prefill-1"].kv_events_port)
    assert env["prefill"]["TANDEM_WORKER_ROLE"] == "prefill" and env["decode"]["TANDEM_WORKER_ROLE"] == "decode"
    pins = {name: e["TANDEM_WORKER_ENGINE__CPU_THREADS_BIND"] for name, e in env.items()}
    assert pins == {"prefill": "0", "prefill-1": "1", "decode": "1"}
    assert stack._router_env()["TANDEM_ROUTER_POLICY"] == "round_robin"


def test_every_component_gets_its_own_roles_certificate_by_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = StackConfig.with_free_ports(pki_dir=tmp_path / "pki")
    stack = LocalStack(config)
    assert config.internal_tls
    gateway, router = stack._gateway_env(), stack._router_env()
    workers = {name: stack._worker_env(name) for name in config.worker_ports()}
    assert gateway["TANDEM_GATEWAY_TLS__ENABLED"] == "True"
    assert gateway["TANDEM_GATEWAY_TLS__CERT_FILE"] == str(tmp_path / "pki" / "gateway.crt")
    assert gateway["TANDEM_GATEWAY_ROUTER_ADDRESS"] == f"127.0.0.1:{config.router_tls_port}"  # the TLS front
    assert router["TANDEM_ROUTER_TLS__KEY_FILE"] == str(tmp_path / "pki" / "router.key")
    assert router["TANDEM_ROUTER_TLS_PORT"] == str(config.router_tls_port)
    assert workers["prefill"]["TANDEM_WORKER_TLS__CERT_FILE"] == str(tmp_path / "pki" / "prefill.crt")
    assert workers["decode"]["TANDEM_WORKER_TLS__CERT_FILE"] == str(tmp_path / "pki" / "decode.crt")
    ca_files = {gateway["TANDEM_GATEWAY_TLS__CA_FILE"], *(e["TANDEM_WORKER_TLS__CA_FILE"] for e in workers.values())}
    assert ca_files == {str(tmp_path / "pki" / "ca.crt")}


def test_plaintext_is_said_explicitly() -> None:
    stack = LocalStack(StackConfig.with_free_ports(internal_tls=False))
    assert stack._gateway_env()["TANDEM_GATEWAY_TLS__ENABLED"] == "false"
    assert stack._worker_env("decode")["TANDEM_WORKER_TLS__ENABLED"] == "false"
    assert stack._gateway_env()["TANDEM_GATEWAY_ROUTER_ADDRESS"] == f"127.0.0.1:{stack.config.router_grpc_port}"


def test_the_router_gets_a_ledger_secret_kept_in_the_cache_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "cache" / "router-ledger-secret"
    stack = LocalStack(StackConfig.with_free_ports(router_ledger_secret_file=path))
    assert stack._router_env()["TANDEM_ROUTER_LEDGER__SECRET_FILE"] == str(path)
    assert ensure_ledger_secret(path) == path
    secret = path.read_bytes()
    assert read_secret(path) == secret.strip() and len(secret.strip()) == 64
    assert path.stat().st_mode & 0o777 == 0o600
    ensure_ledger_secret(path)
    assert path.read_bytes() == secret  # kept across starts, as the chart keeps its Secret


def test_a_stack_with_a_shared_memory_directory_gives_it_to_every_worker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shm_dir = tmp_path / "shm ü 東京"
    stack = LocalStack(StackConfig.with_free_ports(num_prefill_workers=2, num_decode_workers=2, kv_shm_dir=shm_dir))
    assert {stack._worker_env(n)["TANDEM_WORKER_KV__SHM_DIR"] for n in stack.config.worker_ports()} == {str(shm_dir)}
    # None (the default): the workers' own default, /dev/shm, as before.
    assert "TANDEM_WORKER_KV__SHM_DIR" not in LocalStack(StackConfig.with_free_ports())._worker_env("prefill")
