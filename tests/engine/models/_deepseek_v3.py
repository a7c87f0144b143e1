"""Tiny random DeepSeek-V3 checkpoints, written once per test session by transformers'
save_pretrained.

    lora     3 layers (layer 0 dense: first_k_dense_replace 1), MLA with q_lora_rank 24,
             kv_lora_rank 32, rope dims 8 (interleaved), nope 16, v 16, 4 heads; 8 routed experts in
             4 groups, top-2 within the best 2 groups, a non-zero e_score_correction_bias,
             routed_scaling_factor 2.5, one shared expert; YaRN factor 40 with mscale 1 /
             mscale_all_dim 1 as DeepSeek-V3's released config (the softmax scale grows by
             mscale^2); one MTP layer's tensors (model.layers.3.*) added to the file, as the
             released checkpoints carry them
    plain_q  the same shapes with q_lora_rank null (a plain q_proj), rope_interleave false,
             n_group 1 / topk_group 1 (Kimi-K2's routing), norm_topk_prob false
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.engine.models._gpt_oss import VOCAB_SIZE, write_tokenizer

YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
VARIANTS = {
    "lora": {"q_lora_rank": 24, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
             "rope_interleave": True},
    "plain_q": {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                "rope_interleave": False},
}


def make_config(eos_id: int, **variant: object):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5,
        first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, max_position_embeddings=64 * 40, initializer_range=0.2,
        rope_parameters=dict(YARN),
        eos_token_id=eos_id, bos_token_id=None, pad_token_id=None, **variant)


@dataclass
class DeepseekCheckpoint:
    name: str
    directory: Path
    model: torch.nn.Module  # transformers' model, float32, eval mode


def _add_mtp_layer(directory: Path) -> None:
    """Append a copy of the last layer as MTP layer `num_hidden_layers` (the engine must skip
    it)."""
    from safetensors.torch import load_file, save_file

    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    extra = {n.replace("model.layers.2.", "model.layers.3."): t.clone()
             for n, t in tensors.items() if n.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # MTP-only tensors
    save_file({**tensors, **extra}, str(file), metadata={"format": "pt"})


def write_checkpoints(root: Path) -> dict[str, DeepseekCheckpoint]:
    import transformers

    out = {}
    for seed, (name, variant) in enumerate(VARIANTS.items()):
        directory = root / name
        directory.mkdir()
        eos_id = write_tokenizer(directory)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(make_config(eos_id, **variant),
                                                              dtype=torch.float32)
        with torch.no_grad():  # a correction bias that changes which experts are chosen
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
        model.eval().save_pretrained(directory)
        if name == "lora":
            _add_mtp_layer(directory)
        out[name] = DeepseekCheckpoint(name, directory, model)
    return out


@pytest.fixture(scope="session")
def deepseek_v3_checkpoints(
        tmp_path_factory: pytest.TempPathFactory) -> dict[str, DeepseekCheckpoint]:
    torch.set_num_threads(1)
    return write_checkpoints(tmp_path_factory.mktemp("deepseek_v3"))
