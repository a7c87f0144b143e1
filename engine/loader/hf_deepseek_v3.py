"""deepseek_v3 config.json (DeepSeek-V3 / R1, Kimi-K2) -> `ModelConfig` fields (read by
hf_checkpoint.py).

    kv_lora_rank, q_lora_rank (null: plain q_proj),   MLAConfig: the KV cache holds one "kv head" of
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim,   kv_lora_rank + qk_rope_head_dim per token
    rope_interleave (default true)                    (num_kv_heads 1, head_dim that sum)
    n_routed_experts, num_experts_per_tok,            routed experts of moe_intermediate_size
    moe_intermediate_size, norm_topk_prob
    n_shared_experts                                  one shared MLP of n_shared *
                                                      moe_intermediate_size
    n_group, topk_group, routed_scaling_factor        GroupedTopK (sigmoid scores, noaux_tc)
    first_k_dense_replace                             layers 0..k-1 dense (intermediate_size)
    num_nextn_predict_layers                          MTP layers: their tensors (layer index >=
                                                      num_hidden_layers) are skipped at load
rope: YaRN with mscale / mscale_all_dim from `rope_parameters` / `rope_scaling`
(hf_checkpoint._rope); the softmax scale is qk_head_dim^-0.5 * yarn_mscale(factor, mscale_all_dim)^2
(engine/models/deepseek_v3.py).

quantization_config: the released block-scaled FP8 (quant_method "fp8", weight_block_size [128,
128]) is read and dequantized at load (engine/loader/fp8_blocks.py); another quant_method is
refused. Refused, one line each: attention_bias, scoring_func other than sigmoid, topk_method other
than noaux_tc, moe_layer_freq != 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import GroupedTopK, MLAConfig
from engine.loader.checkpoint import UnsupportedCheckpointError


def deepseek_v3_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    def refuse(what: str) -> UnsupportedCheckpointError:
        return UnsupportedCheckpointError(f"deepseek_v3: {what} is not supported")

    quantization = config.get("quantization_config") or {}
    # fp8: engine/loader/fp8_blocks.py
    if quantization and quantization.get("quant_method") != "fp8":
        raise refuse(f"quantization_config quant_method {quantization.get('quant_method')!r} (only "
                     "the released block-scaled 'fp8')")
    if config.get("attention_bias"):
        raise refuse("attention_bias=true (the released models have none)")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise refuse(f"scoring_func {config['scoring_func']!r} (only 'sigmoid')")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise refuse(f"topk_method {config['topk_method']!r} (only 'noaux_tc')")
    if int(config.get("moe_layer_freq", 1)) != 1:
        raise refuse(f"moe_layer_freq {config['moe_layer_freq']} (only 1)")
    num_experts, n_group = int(config["n_routed_experts"]), int(config.get("n_group") or 1)
    if num_experts % n_group or num_experts // n_group < 2 and n_group > 1:
        raise refuse(f"n_group {n_group} over {num_experts} experts (groups of >= 2 experts)")
    mla = MLAConfig(kv_lora_rank=int(config["kv_lora_rank"]),
                    q_lora_rank=int(config["q_lora_rank"]) if config.get("q_lora_rank") else None,
                    qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                    v_head_dim=int(config["v_head_dim"]),
                    rope_interleave=bool(config.get("rope_interleave", True)))
    num_layers = int(config["num_hidden_layers"])
    first_dense = min(int(config.get("first_k_dense_replace") or 0), num_layers)
    moe_size = int(config["moe_intermediate_size"])
    return {"num_experts": num_experts,
            "num_experts_per_tok": int(config["num_experts_per_tok"]),
            "moe_intermediate_size": moe_size,
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
            "shared_expert_intermediate_size": moe_size * int(config.get("n_shared_experts") or 0),
            "mlp_only_layers": tuple(range(first_dense)),
            "num_kv_heads": 1,
            "head_dim": mla.kv_lora_rank + mla.qk_rope_head_dim,
            "mla": mla,
            "grouped_topk": GroupedTopK(n_group, int(config.get("topk_group") or 1),
                                        float(config.get("routed_scaling_factor", 1.0)))}
