"""scripts/prepare_model.py: the generation config it writes into the converted
folder, the up-to-date check that rebuilds a folder without it, and vLLM's own
reader (``ModelConfig.get_diff_sampling_param``, what the worker applies to the
options a client leaves unset) returning the model card's sampling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scripts import prepare_model

RECOMMENDED = {"temperature": 0.2, "top_p": 0.9}


def converted_config(**overrides: Any) -> dict[str, Any]:
    """A ``config.json`` shaped like the converted SmolLM2 folder's (small sizes: nothing is loaded)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "unk_token_id": 0,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "vocab_size": 256,
    }
    config.update(overrides)
    return config


def model_folder(path: Path, config: dict[str, Any], marker: dict[str, Any] | None = None) -> Path:
    """``config.json`` and the generation config as :func:`prepare_model.convert` leaves them, plus a marker."""
    (path / "config.json").write_text(json.dumps(config))
    prepare_model.write_generation_config(path)
    (path / prepare_model.MARKER_FILE_NAME).write_text(json.dumps(marker or {"format_version": 2}))
    return path


def read_generation_config(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((path / prepare_model.GENERATION_CONFIG_FILE_NAME).read_text())
    return result


def vllm_default_sampling(model_dir: Path) -> dict[str, Any]:
    from vllm.config import ModelConfig

    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True)
    defaults: dict[str, Any] = model_config.get_diff_sampling_param()
    return defaults


def test_generation_config_takes_token_ids_from_the_config_and_sampling_from_the_model_card() -> None:
    written = prepare_model.generation_config(converted_config(bos_token_id=1, eos_token_id=[2, 7], pad_token_id=None))
    assert written == {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, **RECOMMENDED}
    assert "_from_model_config" not in written  # written on purpose, not derived from config.json


def test_generation_config_refuses_a_config_without_eos() -> None:
    config = converted_config()
    del config["eos_token_id"]
    with pytest.raises(ValueError, match="eos_token_id"):
        prepare_model.generation_config(config)


def test_write_generation_config_replaces_the_ids_only_file_transformers_saved(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(converted_config()))
    (tmp_path / prepare_model.GENERATION_CONFIG_FILE_NAME).write_text(
        json.dumps({"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2})
    )
    prepare_model.write_generation_config(tmp_path)
    assert read_generation_config(tmp_path) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "do_sample": True,
        **RECOMMENDED,
    }


def test_is_prepared_only_when_the_marker_and_the_generation_config_match(tmp_path: Path) -> None:
    marker = {"format_version": prepare_model.FORMAT_VERSION, "dtype": "bfloat16"}
    folder = model_folder(tmp_path, converted_config(), marker)
    assert prepare_model.is_prepared(folder, marker)
    assert not prepare_model.is_prepared(folder, {**marker, "format_version": 1})

    edited = {**read_generation_config(folder), "temperature": 1.0}
    (folder / prepare_model.GENERATION_CONFIG_FILE_NAME).write_text(json.dumps(edited))
    assert not prepare_model.is_prepared(folder, marker)

    (folder / prepare_model.GENERATION_CONFIG_FILE_NAME).unlink()  # a folder from before FORMAT_VERSION 2
    assert not prepare_model.is_prepared(folder, marker)


@pytest.mark.slow
def test_vllm_reads_the_written_defaults(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, converted_config())
    assert vllm_default_sampling(folder) == RECOMMENDED


PREPARED_DIR = prepare_model.default_cache_dir() / "models" / prepare_model.MODEL_NAME


@pytest.mark.slow
@pytest.mark.skipif(not (PREPARED_DIR / "config.json").is_file(), reason="needs the prepared model (make model)")
def test_the_prepared_folder_gives_vllm_the_model_card_sampling() -> None:
    # A folder prepared before the generation config existed fails here: run `make model`.
    assert vllm_default_sampling(PREPARED_DIR) == RECOMMENDED
    generation = read_generation_config(PREPARED_DIR)
    tokenizer_config = json.loads((PREPARED_DIR / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"  # the chat template's end of turn ...
    vocab = {t["content"]: t["id"] for t in json.loads((PREPARED_DIR / "tokenizer.json").read_text())["added_tokens"]}
    assert generation["eos_token_id"] == vocab["<|im_end|>"]  # ... is where generation stops
