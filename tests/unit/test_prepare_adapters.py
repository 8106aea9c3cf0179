"""scripts/prepare_adapters.py and tests/kit/adapters.py without an engine: the markers that make
``make model`` a no-op the second time and a rebuild when the base model changes, the atomic
write, the kit's "run make model" errors, and (when ``make model`` has run) the prepared folders'
shape: non-zero LoRA B weights, rank 8 on the attention projections, the merged model's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import model_folder, prepare_adapters
from tests.kit import adapters

BASE_MARKER = {"format_version": 2, "dtype": "bfloat16"}


def test_marker_matches_only_what_was_written(tmp_path: Path) -> None:
    marker = prepare_adapters.adapter_marker("tandem-test-a", BASE_MARKER)
    model_folder.publish(tmp_path / "a", marker, lambda out: (out / "x").write_text("é"))
    assert prepare_adapters.has_marker(tmp_path / "a", marker)
    assert (tmp_path / "a" / "x").read_text() == "é"
    rebuilt_base = prepare_adapters.adapter_marker("tandem-test-a", {**BASE_MARKER, "dtype": "float32"})
    assert not prepare_adapters.has_marker(tmp_path / "a", rebuilt_base)
    assert not prepare_adapters.has_marker(
        tmp_path / "a", prepare_adapters.adapter_marker("tandem-test-b", BASE_MARKER)
    )
    assert not prepare_adapters.has_marker(tmp_path / "missing", marker)
    (tmp_path / "a" / model_folder.MARKER_FILE_NAME).write_text("{not json")
    assert not prepare_adapters.has_marker(tmp_path / "a", marker)


def test_a_failed_write_leaves_the_old_folder_and_no_temporary(tmp_path: Path) -> None:
    marker = prepare_adapters.adapter_marker("tandem-test-a", BASE_MARKER)
    model_folder.publish(tmp_path / "a", marker, lambda out: (out / "x").write_text("old"))

    def fail(out: Path) -> None:
        (out / "x").write_text("half")
        raise RuntimeError("SIMULATED: the conversion died")

    with pytest.raises(RuntimeError):
        model_folder.publish(tmp_path / "a", {"other": 1}, fail)
    assert (tmp_path / "a" / "x").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_published_folder_is_readable_by_all_and_its_files_keep_their_mode_unless_told(tmp_path: Path) -> None:
    """The adapters' files are made 0644 (safetensors writes 0600); the default model's are left as written
    (prepare_model.py passes no file_mode); both folders are 0755 (mkdtemp makes them 0700)."""

    def private(out: Path) -> None:
        (out / "weights").write_text("w")
        (out / "weights").chmod(0o600)

    model_folder.publish(tmp_path / "adapter", {"a": 1}, private, file_mode=prepare_adapters.FILE_MODE)
    model_folder.publish(tmp_path / "model", {"m": 1}, private)
    assert (tmp_path / "adapter" / "weights").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "model" / "weights").stat().st_mode & 0o777 == 0o600
    assert {(tmp_path / name).stat().st_mode & 0o777 for name in ("adapter", "model")} == {0o755}
    assert model_folder.has_marker(tmp_path / "model", {"m": 1})
    assert model_folder.MARKER_FILE_NAME == ".tandem-prepared.json"  # the name folders prepared before have


def test_the_kit_says_run_make_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="run make model"):
        adapters.adapter_path("tandem-test-a")
    with pytest.raises(FileNotFoundError, match="run make model"):
        adapters.second_model_path()
    with pytest.raises(ValueError, match="unknown test adapter"):
        adapters.adapter_path("../models")
    folder = tmp_path / "adapters" / "tandem-test-a"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"adapter_model\.safetensors"):
        adapters.adapter_path("tandem-test-a")


def test_the_kit_and_the_script_agree_on_names() -> None:
    assert tuple(prepare_adapters.ADAPTER_SEEDS) == adapters.ADAPTER_NAMES
    assert adapters.MERGED_ADAPTER == prepare_adapters.MERGED_ADAPTER
    assert adapters.SECOND_MODEL_NAME == prepare_adapters.MERGED_MODEL_NAME
    assert adapters.ADAPTER_RANK == prepare_adapters.LORA_RANK


def _prepared() -> bool:
    try:
        adapters.second_model_path()
        for name in adapters.ADAPTER_NAMES:
            adapters.adapter_path(name)
    except FileNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _prepared(), reason="make model has not prepared the adapters")
def test_the_prepared_adapters_have_non_zero_distinct_weights() -> None:
    from safetensors.torch import load_file

    weights = {
        name: load_file(str(adapters.adapter_path(name) / "adapter_model.safetensors"))
        for name in adapters.ADAPTER_NAMES
    }
    for name, tensors in weights.items():
        config = json.loads((adapters.adapter_path(name) / "adapter_config.json").read_text())
        assert config["r"] == adapters.ADAPTER_RANK and config["peft_type"] == "LORA"
        assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
        b_keys = [key for key in tensors if "lora_B" in key]
        assert len(b_keys) == 30 * 4, name  # 30 layers, four projections
        assert all(float(tensors[key].abs().max()) > 0 for key in b_keys), name
    first_key = next(key for key in weights["tandem-test-a"] if "lora_B" in key)
    assert not weights["tandem-test-a"][first_key].equal(weights["tandem-test-b"][first_key])
    config = json.loads((adapters.second_model_path() / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and "quantization_config" not in config
    assert (adapters.second_model_path() / "tokenizer.json").is_file()
