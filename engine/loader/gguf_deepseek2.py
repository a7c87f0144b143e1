"""DeepSeek-V3 / R1 GGUF files (llama.cpp architecture `deepseek2`) -> `Checkpoint` with the
Hugging Face `deepseek_v3` names and layout, so the model is the one hf_deepseek_v3.py configures.

Metadata `deepseek2.*` -> the config.json fields hf_deepseek_v3.py reads:

    attention.q_lora_rank (0 or absent: a plain attn_q), attention.kv_lora_rank
    rope.dimension_count                      qk_rope_head_dim
    attention.key_length_mla / value_length_mla (newer converters, which write head_count_kv 1 and
      key_length = kv_lora_rank + rope dims), else attention.key_length / value_length
                                              qk_nope_head_dim + qk_rope_head_dim, v_head_dim
    leading_dense_block_count                 first_k_dense_replace
    expert_count / expert_used_count / expert_shared_count / expert_feed_forward_length
    expert_weights_scale / expert_weights_norm routed_scaling_factor / norm_topk_prob
    expert_gating_func (2 = sigmoid)          scoring_func
    expert_group_count / expert_group_used_count   n_group / topk_group
    rope.scaling.type yarn, factor, original_context_length, yarn_log_multiplier (= 0.1 *
      mscale_all_dim, llama.cpp's reading of DeepSeek's YaRN; mscale is taken equal to it)

Tensors: llama.cpp's GGML NORM rope rotates adjacent pairs, as DeepSeek's interleaved rope does, so
nothing is permuted (rope_interleave true). kv_b_proj comes as one `attn_kv_b` (older converters)
or split for MLA absorption: `attn_k_b` [heads, kv_lora_rank, nope] (transposed) and `attn_v_b`
[heads, v_head_dim, kv_lora_rank], joined back into kv_b_proj [heads * (nope + v), kv_lora_rank].
Stacked experts ffn_{gate,up,down}_exps become the fused `mlp.experts.gate_up_proj` /
`down_proj`; `exp_probs_b.bias` is the router's e_score_correction_bias.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from chat.gguf_metadata import GGUFTensorInfo
from chat.special_tokens import collect_eos_token_ids
from engine.loader.checkpoint import Checkpoint, UnsupportedCheckpointError

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_MODULES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
TensorReader = Callable[[GGUFTensorInfo, gguf.GGMLQuantizationType], np.ndarray]


def hf_config(metadata: Mapping[str, object]) -> dict[str, Any]:
    """The deepseek_v3 config.json the GGUF's metadata describes."""
    def get(key: str, default: object = None) -> Any:
        value = metadata.get(f"deepseek2.{key}", default)
        if value is None:
            raise UnsupportedCheckpointError(f"deepseek2 GGUF: no metadata deepseek2.{key}")
        return value

    rope_dims = int(get("rope.dimension_count"))
    key_length = int(metadata.get("deepseek2.attention.key_length_mla")
                     or get("attention.key_length"))
    v_head_dim = int(metadata.get("deepseek2.attention.value_length_mla")
                     or get("attention.value_length"))
    gating = int(get("expert_gating_func", _SIGMOID))
    rope: dict[str, Any] = {"rope_theta": float(get("rope.freq_base", 10000.0))}
    if metadata.get("deepseek2.rope.scaling.type") == "yarn":
        # stored as a float32 0.1 * mscale_all_dim: rounded back to the config's decimal value
        mscale = round(float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
        rope.update(rope_type="yarn", factor=float(get("rope.scaling.factor")),
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
                    beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                    mscale=mscale, mscale_all_dim=mscale)
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    assert isinstance(tokens, list)
    return {
        "model_type": "deepseek_v3", "vocab_size": int(get("vocab_size", len(tokens))),
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(get("attention.head_count")),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope, "rope_interleave": True,
        "q_lora_rank": int(metadata.get("deepseek2.attention.q_lora_rank") or 0) or None,
        "kv_lora_rank": int(get("attention.kv_lora_rank")), "qk_rope_head_dim": rope_dims,
        "qk_nope_head_dim": key_length - rope_dims, "v_head_dim": v_head_dim,
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "n_routed_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "scoring_func": "sigmoid" if gating == _SIGMOID else f"expert_gating_func {gating}",
        "n_group": int(get("expert_group_count", 1)),
        "topk_group": int(get("expert_group_used_count", 1)),
    }


def hf_tensor_name(gguf_name: str) -> str:
    """The HF name of a deepseek2 GGUF tensor (attn_k_b / attn_v_b: see `_join_kv_b`)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None:
        raise KeyError(gguf_name)
    layer, module, kind = match.groups()
    if module == "exp_probs_b":
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    if module in ("attn_k_b", "attn_v_b"):
        return f"model.layers.{layer}.self_attn.{module.removeprefix('attn_')}"
    if module not in _MODULES:
        raise KeyError(gguf_name)
    return f"model.layers.{layer}.{_MODULES[module]}.{kind}"


def load_deepseek2_gguf(path: Path, metadata: Mapping[str, object], infos: list[GGUFTensorInfo],
                        read: TensorReader, dtype: torch.dtype = torch.float32,
                        progress: bool = True) -> Checkpoint:
    from engine.loader.gguf_checkpoint import _fuse_stacked_experts
    from engine.loader.hf_checkpoint import model_config_from_fields

    config = hf_config(metadata)
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    assert isinstance(tokens, list)
    eos, bos = (metadata.get("tokenizer.ggml.eos_token_id"),
                metadata.get("tokenizer.ggml.bos_token_id"))
    token_index = {token: i for i, token in enumerate(tokens)}
    model_config = dataclasses.replace(
        model_config_from_fields(config, model_id=path.stem),
        tie_word_embeddings="output.weight" not in {i.name for i in infos},
        eos_token_ids=collect_eos_token_ids([eos] if isinstance(eos, int) else [], token_index.get),
        bos_token_id=bos if isinstance(bos, int) else None)
    weights: dict[str, torch.Tensor] = {}
    for info in tqdm(infos, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        if info.name == "rope_freqs.weight":
            continue
        try:
            name = hf_tensor_name(info.name)
        except KeyError:
            raise UnsupportedCheckpointError(
                f"{path.name}: GGUF tensor {info.name!r} is not part of a deepseek2 model this "
                "engine reads") from None
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= model_config.num_layers:
            continue  # an MTP layer (a converter that keeps the nextn layers)
        ggml_type = gguf.GGMLQuantizationType(info.ggml_type)
        values = gguf.quants.dequantize(read(info, ggml_type), ggml_type)
        weights[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)
    _join_kv_b(weights)
    _fuse_stacked_experts(weights)
    return Checkpoint(config=model_config, weights=weights, raw={})


def _join_kv_b(weights: dict[str, torch.Tensor]) -> None:
    """attn_k_b [H, R, nope] and attn_v_b [H, v, R] -> kv_b_proj [H * (nope + v), R], in place."""
    for k_name in [n for n in weights if n.endswith(".self_attn.k_b")]:
        prefix = k_name.removesuffix("k_b")
        k_b, v_b = weights.pop(k_name), weights.pop(prefix + "v_b", None)
        if v_b is None:
            raise UnsupportedCheckpointError(f"deepseek2 GGUF has {k_name} but no v_b")
        joined = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope + v, R]
        weights[prefix + "kv_b_proj.weight"] = joined.reshape(-1, k_b.shape[1]).contiguous()
