"""Hugging Face directories: config.json mapping, safetensors weights, tokenizer.json."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelConfig
from engine.loader import default_model_path, load_checkpoint, load_tokenizer
from engine.loader.hf_checkpoint import model_config_from_hf

transformers = pytest.importorskip("transformers")
torch.set_num_threads(2)

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 49152}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, transformers_gguf_tokenizer):
    """A tiny random Llama saved in two safetensors shards, with SmolLM2's tokenizer (as
    transformers reads it from the GGUF: the session's, tests/conftest.py)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, eos_token_id=2, bos_token_id=1)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size="8MB")
    transformers_gguf_tokenizer.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return directory, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_llama_dir_config_maps_to_model_config(llama_dir):
    directory, _ = llama_dir
    config = load_checkpoint(directory, progress=False).config
    assert (config.architecture, config.hidden_size, config.num_layers) == ("llama", 64, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.intermediate_size, config.vocab_size) == (128, 49152)
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == 1e-6 and not config.tie_word_embeddings
    # config eos, generation_config eos list, then end-of-turn tokens found in tokenizer.json
    assert config.eos_token_ids == (2, 5, 0)
    assert config.bos_token_id == 1
    assert config.model_id == directory.name


def test_llama_dir_weights_equal_the_saved_state_dict(llama_dir):
    directory, state = llama_dir
    assert len(list(directory.glob("*.safetensors"))) > 1  # sharded
    checkpoint = load_checkpoint(directory, dtype=torch.bfloat16, progress=False)
    assert checkpoint.raw == {}
    assert set(checkpoint.weights) == set(state)
    for name, tensor in state.items():
        assert torch.equal(checkpoint.weights[name], tensor.to(torch.bfloat16)), name


def test_llama_dir_tokenizer_matches_the_gguf_tokenizer(llama_dir):
    directory, _ = llama_dir
    from_dir, from_gguf = load_tokenizer(directory), load_tokenizer(default_model_path())
    text = "<|im_start|>user\nCode: x = 12 + 3 🤗 中文<|im_end|>"
    assert from_dir.encode(text) == from_gguf.encode(text)
    assert from_dir.eos_token_ids == (2, 5, 0)
    assert from_dir.bos_token_id == 1
    conversation = [{"role": "user", "content": "hi"}]
    assert from_dir.apply_chat_template(conversation) == from_gguf.apply_chat_template(conversation)


def _config_dir(tmp_path, config) -> ModelConfig:
    config.save_pretrained(tmp_path)
    return model_config_from_hf(tmp_path)


def test_mixtral_config_maps_experts(tmp_path):
    config = _config_dir(tmp_path, transformers.MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2))
    assert ((config.architecture, config.num_experts, config.num_experts_per_tok)
            == ("mixtral", 4, 2))
    assert config.moe_intermediate_size == 128 and config.norm_topk_prob
    assert config.head_dim == 16 and config.rope_theta == 1e6 and config.is_moe


def test_qwen2_moe_config_maps_shared_expert_and_bias(tmp_path):
    config = _config_dir(tmp_path, transformers.Qwen2MoeConfig(
        **TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=96, norm_topk_prob=False))
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == (
        "qwen2_moe", 8, 2)
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (32, 96)
    assert not config.norm_topk_prob and config.attention_bias and not config.qk_norm


def test_olmoe_config_maps_qk_norm(tmp_path):
    config = _config_dir(tmp_path, transformers.OlmoeConfig(
        **TINY, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True))
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("olmoe", 8, 2)
    assert config.moe_intermediate_size == 128 and config.norm_topk_prob and config.qk_norm


def test_qwen2_config_has_attention_bias(tmp_path):
    config = _config_dir(tmp_path, transformers.Qwen2Config(**TINY))
    assert config.architecture == "qwen2" and config.attention_bias and not config.is_moe


def test_legacy_rope_scaling_is_kept_as_sorted_items(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", **TINY, "max_position_embeddings": 4096, "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [7, 9]}))
    config = model_config_from_hf(tmp_path)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == (("factor", 2.0), ("rope_type", "linear"))
    assert config.eos_token_ids == (7, 9)  # no tokenizer.json: no end-of-turn lookup


def test_unsupported_model_type_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **TINY}))
    with pytest.raises(NotImplementedError, match="gpt2"):
        model_config_from_hf(tmp_path)
