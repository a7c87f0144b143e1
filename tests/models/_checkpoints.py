"""Tiny random-weight MoE checkpoints of each family, written by transformers' save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False)

FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **COMMON),
    "qwen2_moe-shared": lambda: transformers.Qwen2MoeConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, **COMMON),
    "qwen2_moe-normalized-no-shared": lambda: transformers.Qwen2MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=0,
        norm_topk_prob=True, **COMMON),
    "qwen2_moe-mlp-only-layer-0": lambda: transformers.Qwen2MoeConfig(  # layer 0 dense, layer 1 sparse
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, mlp_only_layers=[0], **COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                              **COMMON),
}


def write_checkpoint(family: str, directory: Path, initializer_range: float | None = None) -> torch.nn.Module:
    """Save a seeded random model of `family` into `directory`; returns the transformers model."""
    config = FAMILIES[family]()
    if initializer_range is not None:
        config.initializer_range = initializer_range
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    return model
