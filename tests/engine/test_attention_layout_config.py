"""ModelConfig's attention layout (layer_types + sliding_window) and how config.json maps to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ModelConfig
from engine.loader.hf_checkpoint import model_config_from_hf

BASE = dict(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=4,
            num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)


def test_layer_types_give_each_layer_its_window() -> None:
    config = ModelConfig(**BASE, layer_types=("sliding_attention", "full_attention") * 2,
                         sliding_window=8)
    assert [config.layer_sliding_window(i) for i in range(4)] == [8, None, 8, None]
    assert config.has_sliding_layers
    assert not ModelConfig(**BASE).has_sliding_layers  # no layer_types: every layer full


@pytest.mark.parametrize(("fields", "message"), [
    ({"layer_types": ("full_attention",) * 3}, "names 3 layers"),
    ({"layer_types": ("chunked_attention",) * 4, "sliding_window": 8}, "unsupported layer_types"),
    ({"layer_types": ("sliding_attention",) * 4}, "sliding_window is not set"),
    ({"sliding_window": 8}, "layer_types is not"),
    ({"layer_types": ("sliding_attention",) * 4, "sliding_window": 0}, "must be >= 1"),
])
def test_inconsistent_layouts_are_refused_at_construction(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**BASE, **fields)


def _hf_config(tmp_path: Path, **fields: object) -> ModelConfig:
    config = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
              **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return model_config_from_hf(tmp_path)


def test_mistral_window_applies_to_every_layer_with_transformers_default(tmp_path: Path) -> None:
    explicit = _hf_config(tmp_path, model_type="mistral", sliding_window=16)
    assert explicit.layer_types == ("sliding_attention",) * 3 and explicit.sliding_window == 16
    absent = _hf_config(tmp_path, model_type="mistral")  # MistralConfig's default
    assert absent.sliding_window == 4096 and absent.has_sliding_layers
    off = _hf_config(tmp_path, model_type="mistral", sliding_window=None)
    assert not off.has_sliding_layers and off.sliding_window is None


def test_mixtral_has_no_window_unless_its_config_sets_one(tmp_path: Path) -> None:
    moe = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    assert not _hf_config(tmp_path, **moe).has_sliding_layers
    assert _hf_config(tmp_path, **moe, sliding_window=8).layer_sliding_window(2) == 8


def test_llama_configs_keep_full_attention(tmp_path: Path) -> None:
    assert _hf_config(tmp_path, model_type="llama").layer_types is None


def test_gpt_oss_window_defaults_to_transformers_128_when_config_has_no_key(tmp_path: Path) -> None:
    moe = {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8}
    absent = _hf_config(tmp_path, **moe)  # GptOssConfig's default
    assert absent.sliding_window == 128
    assert [absent.layer_sliding_window(i) for i in range(3)] == [128, None, 128]
    assert _hf_config(tmp_path, **moe, sliding_window=32).sliding_window == 32
