"""llama4_text config.json -> `ModelConfig` fields (read by hf_checkpoint.py), as transformers'
Llama4TextConfig reads it:

    no_rope_layers                  per layer 1 = RoPE (and chunked attention), 0 = NoPE (global);
                                    absent: NoPE every `no_rope_layer_interval` (4) layers, the 4th
    attention_chunk_size (8192)     the RoPE layers' chunk C (null: those layers attend globally)
    layer_types                     must agree with the two above ("chunked_attention" exactly on
                                    the RoPE layers when C is set)
    moe_layers                      the layers with experts; absent: every
                                    `interleave_moe_layer_step`-th layer (step - 1, 2 * step - 1,
                                    ...)
    num_local_experts, num_experts_per_tok, intermediate_size (each expert's and the shared
    expert's), intermediate_size_mlp (the dense layers' MLP)
    use_qk_norm (True)              L2 q/k norm on the RoPE layers
    attn_temperature_tuning (True), floor_scale (8192), attn_scale (0.1)   the NoPE layers' query
                                                                           scale
    rope_parameters / rope_theta + rope_scaling   one rope for every RoPE layer (llama3 scaling as
                                                  released)

Refused in one line: attention_bias, a hidden_act other than silu, layer_types that disagree.
Multimodal `llama4` checkpoints (Llama4ForConditionalGeneration: a `text_config` inside, tensors
language_model.*, vision_model.*, multi_modal_projector.*) load as their text model: the config is
the text_config, the language_model.* tensors lose that prefix and the vision tower and projector
are not read (images are not supported).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import Llama4Config
from engine.loader.checkpoint import UnsupportedCheckpointError


def text_config_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """A `llama4` config.json -> its text model's, as a `llama4_text` config."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise UnsupportedCheckpointError("llama4: config.json has no text_config")
    return {"eos_token_id": config.get("eos_token_id"), "bos_token_id": config.get("bos_token_id"),
            **{k: v for k, v in text.items() if v is not None}, "model_type": "llama4_text"}


def text_tensor_name(name: str) -> str | None:
    """A `llama4` checkpoint's tensor name -> the text model's (None: the vision part, not read)."""
    prefix = "language_model."
    return name[len(prefix):] if name.startswith(prefix) else None


def llama4_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    num_layers = int(config["num_hidden_layers"])
    if config.get("attention_bias"):
        raise UnsupportedCheckpointError("llama4_text: attention_bias=True is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpointError(f"llama4_text: hidden_act {config['hidden_act']!r} is not "
                                         "supported")
    interval = int(config.get("no_rope_layer_interval") or 4)
    rope_layers = tuple(bool(v) for v in config.get("no_rope_layers")
                        or [(i + 1) % interval != 0 for i in range(num_layers)])
    if len(rope_layers) != num_layers:
        raise UnsupportedCheckpointError(
            f"llama4_text: no_rope_layers names {len(rope_layers)} layers, the model has "
            f"{num_layers}")
    chunk = config.get("attention_chunk_size", 8192)
    chunk = int(chunk) if chunk is not None else None
    if chunk is not None and chunk < 1:
        raise UnsupportedCheckpointError(f"llama4_text: attention_chunk_size={chunk} must be >= 1")
    expected = ["chunked_attention" if rope and chunk is not None else "full_attention"
                for rope in rope_layers]
    if config.get("layer_types") and list(config["layer_types"]) != expected:
        raise UnsupportedCheckpointError(
            f"llama4_text: layer_types {config['layer_types']} disagree with no_rope_layers and "
            f"attention_chunk_size (chunked attention on the RoPE layers only is supported)")
    step = int(config.get("interleave_moe_layer_step") or 1)
    moe_layers = config.get("moe_layers")
    moe = tuple(int(i) for i in (moe_layers if moe_layers is not None
                                 else range(step - 1, num_layers, step)))
    num_experts = int(config["num_local_experts"]) if moe else 0
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(config["num_experts_per_tok"]) if moe else 0,
        "moe_intermediate_size": int(config["intermediate_size"]),
        "shared_expert_intermediate_size": int(config["intermediate_size"]),
        "decoder_sparse_step": step,
        "llama4": Llama4Config(
            rope_layers=rope_layers, attention_chunk_size=chunk, moe_layers=moe,
            intermediate_size_mlp=int(config.get("intermediate_size_mlp", 16384)),
            use_qk_norm=bool(config.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(config.get("attn_temperature_tuning", True)),
            floor_scale=float(config.get("floor_scale", 8192)),
            attn_scale=float(config.get("attn_scale", 0.1))),
    }
