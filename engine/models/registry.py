"""Model registry: architecture name -> how to build it.

Every family is `LlamaModel` (dense MLPs) or `LlamaModel` with `moe_mlp_factory` (routed experts);
a model takes the tensors it needs by name and shape, and a checkpoint tensor left over afterwards
is refused (engine/models/weights.py), so a misfit fails at load with one line.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.layers.attention import PagedAttentionBackend
from engine.models.llama import CPU, LinearFactory, LlamaModel
from engine.models.weights import check_all_used

_DENSE = {"llama", "mistral", "qwen2", "qwen3", "smollm"}
_MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor],
                attention: PagedAttentionBackend,
                make_linear: LinearFactory, device: torch.device = CPU,
                dtype: torch.dtype = torch.float32) -> LlamaModel:
    arch = config.architecture
    if arch in _DENSE:
        model = LlamaModel(config, weights, attention, make_linear, device=device, dtype=dtype)
    elif arch in _MOE:
        from engine.models.moe import moe_mlp_factory

        model = LlamaModel(config, weights, attention, make_linear, mlp_factory=moe_mlp_factory,
                           device=device, dtype=dtype)
    elif arch == "gpt_oss":  # sinks, sliding windows, clamped-SwiGLU experts, MXFP4 (gpt_oss.py)
        from engine.models.gpt_oss import GptOssModel

        model = GptOssModel(config, weights, attention, make_linear, device=device, dtype=dtype)  # type: ignore[assignment]
    elif arch == "deepseek_v3":  # latent attention, grouped top-k routing (deepseek_v3.py)
        from engine.models.deepseek_v3 import DeepseekV3Model

        model = DeepseekV3Model(config, weights, attention, make_linear, device=device, dtype=dtype)  # type: ignore[assignment]
    elif arch == "gemma3_text":  # local/global layers, two rope bases, (1 + w) norms (gemma3.py)
        from engine.models.gemma3 import Gemma3Model

        model = Gemma3Model(config, weights, attention, make_linear, device=device, dtype=dtype)  # type: ignore[assignment]
    # chunked RoPE layers, NoPE global layers, interleaved MoE (llama4.py)
    elif arch == "llama4_text":
        from engine.models.llama4 import Llama4Model

        model = Llama4Model(config, weights, attention, make_linear, device=device, dtype=dtype)  # type: ignore[assignment]
    else:
        supported = sorted(_DENSE | _MOE | {"gpt_oss", "deepseek_v3", "gemma3_text", "llama4_text"})
        raise ValueError(f"unsupported architecture {arch!r} (supported: {supported})")
    check_all_used(weights, arch)
    return model
