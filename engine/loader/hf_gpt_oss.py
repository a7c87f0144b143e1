"""gpt_oss config.json -> `ModelConfig` fields (read by hf_checkpoint.py).

    num_local_experts, num_experts_per_tok    experts (expert size = intermediate_size)
    layer_types, sliding_window               "sliding_attention" / "full_attention" per layer;
                                              transformers' defaults when absent: sliding on even
                                              layers (0, 2, ...), window 128 (GptOssConfig's)
    swiglu_alpha (1.702), swiglu_limit (7.0)  the experts' clamped SwiGLU
    attention_bias (default True)             q/k/v/o biases (the engine requires them)
    quantization_config                       absent (dense experts) or quant_method "mxfp4": the
                                              experts' *_blocks / *_scales tensors
                                              (engine/layers/mxfp4.py); the `modules_to_not_convert`
                                              of the released configs are the attention, router,
                                              embedding and lm head: dense as stored
rope: YaRN from `rope_parameters` / `rope_scaling` (hf_checkpoint._rope), applied by
engine/layers/rotary.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.loader.checkpoint import UnsupportedCheckpointError


def gpt_oss_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    quantization = config.get("quantization_config") or {}
    method = quantization.get("quant_method")
    if method not in (None, "mxfp4"):
        raise UnsupportedCheckpointError(f"gpt_oss: quantization_config.quant_method {method!r} is "
                                         "not supported (only the released checkpoints' 'mxfp4')")
    if not config.get("attention_bias", True):
        raise UnsupportedCheckpointError("gpt_oss: attention_bias=false is not supported (the "
                                         "released models have q/k/v/o biases)")
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    return {"num_experts": config["num_local_experts"],
            "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["intermediate_size"],
            "attention_bias": True,
            "layer_types": tuple(layer_types),
            "sliding_window": config.get("sliding_window", 128),
            "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(config.get("swiglu_limit", 7.0))}
