"""LocalStack with several base models (issue 40): each further model gets a prefill and a decode worker of
its own (its folder and served name, its own ports, engines pinned round the cores), the gateway serves
them all (TANDEM_GATEWAY_MODELS, read back by GatewaySettings); one model by default, ``--second-model``
adds the merged model ``make model`` prepares. No processes started; the real stack:
tests/integration/test_two_models.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.gateway.settings import GatewaySettings
from tandem.local.__main__ import config_from_args, parse_args
from tandem.local.stack import ExtraModel, LocalStack, StackConfig, default_second_model_dir

SECOND = "SmolLM2-135M-Instruct-tandem-merged"


def _two_models(**overrides: object) -> StackConfig:
    return StackConfig.with_free_ports(
        extra_models=[ExtraModel.free(Path("/models") / SECOND)], internal_tls=False, **overrides
    )


def test_each_model_has_its_own_workers_on_their_own_ports() -> None:
    config = _two_models()
    workers = config.worker_ports()
    assert list(workers) == ["prefill", "decode", "prefill-m1", "decode-m1"]
    ports = [p for w in workers.values() for p in (w.port, w.kv_port, w.metrics_port, w.kv_events_port)]
    assert len(set(ports)) == len(ports)
    stack = LocalStack(config)
    env = {name: stack._worker_env(name) for name in workers}
    models = {
        n: (e["TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME"], e["TANDEM_WORKER_ENGINE__MODEL_DIR"]) for n, e in env.items()
    }
    default = (config.served_model_name, str(config.model_dir))
    assert models == {
        "prefill": default,
        "decode": default,
        "prefill-m1": (SECOND, f"/models/{SECOND}"),
        "decode-m1": (SECOND, f"/models/{SECOND}"),
    }
    roles = {n: e["TANDEM_WORKER_ROLE"] for n, e in env.items()}
    assert roles == {"prefill": "prefill", "decode": "decode", "prefill-m1": "prefill", "decode-m1": "decode"}


def test_four_engines_on_two_cores_two_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    stack = LocalStack(_two_models())
    pins = {n: stack._worker_env(n)["TANDEM_WORKER_ENGINE__CPU_THREADS_BIND"] for n in stack.config.worker_ports()}
    assert pins == {"prefill": "0", "decode": "1", "prefill-m1": "1", "decode-m1": "0"}


def test_the_gateway_serves_every_model(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _two_models(max_model_len=2048)
    env = LocalStack(config)._gateway_env()
    assert json.loads(env["TANDEM_GATEWAY_MODELS"]) == [
        {"name": config.served_model_name, "model_dir": str(config.model_dir), "max_model_len": 2048},
        {"name": SECOND, "model_dir": f"/models/{SECOND}", "max_model_len": 2048},
    ]
    # What the gateway process reads from that environment.
    for name, value in env.items():
        if name.startswith("TANDEM_GATEWAY_"):
            monkeypatch.setenv(name, value)
    settings = GatewaySettings()
    assert [m.name for m in settings.models] == [config.served_model_name, SECOND]
    assert settings.default_model.name == config.served_model_name


def test_one_model_by_default() -> None:
    config = config_from_args(parse_args([]))
    assert config.extra_models == []
    assert list(config.worker_ports()) == ["prefill", "decode"]
    assert "TANDEM_GATEWAY_MODELS" not in LocalStack(config)._gateway_env()


def test_the_second_model_switch(tmp_path: Path) -> None:
    config = config_from_args(parse_args(["--second-model", "--extra-model", str(tmp_path / "other 模型")]))
    assert [(m.name, m.model_dir) for m in config.extra_models] == [
        (SECOND, default_second_model_dir()),
        ("other 模型", tmp_path / "other 模型"),
    ]
    assert list(config.worker_ports()) == ["prefill", "decode", "prefill-m1", "decode-m1", "prefill-m2", "decode-m2"]
    assert config.worker_model("decode-m2") == ("other 模型", tmp_path / "other 模型")
    assert config.worker_model("decode") == (config.served_model_name, config.model_dir)


def test_a_missing_model_folder_is_named_before_anything_starts(tmp_path: Path) -> None:
    from tandem.local.stack import StackError

    (tmp_path / "default").mkdir()
    (tmp_path / "default" / "config.json").write_text("{}")
    config = StackConfig.with_free_ports(
        model_dir=tmp_path / "default", extra_models=[ExtraModel.free(tmp_path / "absent")], internal_tls=False
    )
    with pytest.raises(StackError, match="absent"):
        LocalStack(config).start()
