"""Gateway settings come from TANDEM_GATEWAY_* variables, groups nested with __."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.gateway.settings import GatewaySettings


def test_defaults() -> None:
    settings = GatewaySettings()
    assert (settings.port, settings.served_model_name, settings.max_model_len) == (
        8080,
        "SmolLM2-135M-Instruct",
        4096,
    )
    assert settings.router_address == "127.0.0.1:9000"
    assert settings.model_dir == Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GATEWAY_PORT", "9999")
    monkeypatch.setenv("TANDEM_GATEWAY_ROUTER_ADDRESS", "router:9000")
    monkeypatch.setenv("TANDEM_GATEWAY_REDIS__URL", "redis://redis:6379/3")
    monkeypatch.setenv("TANDEM_GATEWAY_REGISTRY__KEY_PREFIX", "stack-b")
    settings = GatewaySettings()
    assert settings.port == 9999
    assert settings.router_address == "router:9000"
    assert settings.redis.url == "redis://redis:6379/3"
    assert settings.registry.key_prefix == "stack-b"


def test_bad_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GATEWAY_MAX_MODEL_LEN", "1")
    with pytest.raises(ValueError, match="max_model_len"):
        GatewaySettings()
