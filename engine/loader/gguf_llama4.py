"""Llama 4 text GGUF files (llama.cpp architecture `llama4`) -> `Checkpoint` with the Hugging Face
`llama4_text` names and layout, so the model is the one hf_llama4.py configures.

llama.cpp's converter writes the llama fields plus `interleave_moe_layer_step` and
`expert_feed_forward_length`; llama-model.cpp hard-codes the rest for the architecture, and so do
we where the file says nothing:

    feed_forward_length / expert_feed_forward_length   intermediate_size_mlp / intermediate_size
    expert_count, expert_used_count                    num_local_experts, num_experts_per_tok
    interleave_moe_layer_step                          MoE on layers step - 1, 2 * step - 1, ...
    attention.sliding_window                           0: no chunks and RoPE on every layer
                                                       (MobileLLM); absent: chunks of 8,192; a
                                                       positive value: chunks of that many tokens
    attention.sliding_window_pattern                   per layer, True = RoPE + chunked layer;
                                                       absent: every 4th layer NoPE (global)
    attention.temperature_scale / temperature_length   attn_scale / floor_scale of the NoPE layers'
                                                       temperature tuning (absent: 0.1 / 8,192)
    L2 q/k norm                                        on, but for 128 experts (Maverick), as
                                                       llama.cpp decides it
    rope.freq_base + the `rope_freqs` tensor           llama3 rope scaling, baked by the converter
                                                       into per-frequency factors: read as they are
                                                       (rope type "freq_factors",
                                                        engine/layers/rotary.py)

Tensors: Llama 4's rope is interleaved in HF and in GGML alike, so q/k are stored unpermuted (the
converter's `undo_permute = False`); the model permutes them at load as it does for HF files. The
stacked experts ffn_gate_exps / ffn_up_exps [E, I, H] join into HF's `experts.gate_up_proj`
[E, H, 2I] and ffn_down_exps [E, H, I] becomes `experts.down_proj` [E, I, H] (the converter split
and transposed them); ffn_*_shexp is the shared expert, ffn_gate_inp the router.
"""

from __future__ import annotations

import dataclasses
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
from engine.loader.gguf_names import hf_name_from_tables

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_MODULES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj",
    "ffn_gate_inp": "feed_forward.router", "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
    "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
    "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
    "ffn_gate_exps": "feed_forward.experts.gate_proj",
    "ffn_up_exps": "feed_forward.experts.up_proj",
    "ffn_down_exps": "feed_forward.experts.down_proj",
}
LLAMA_CPP_CHUNK_SIZE = 8192  # llama-model.cpp's LLM_ARCH_LLAMA4 n_swa
LLAMA_CPP_NOPE_STEP = 4  # n_no_rope_layer_step: every 4th layer NoPE
LLAMA_CPP_TEMPERATURE = (0.1, 8192)  # f_attn_temp_scale, n_attn_temp_floor_scale
MAVERICK_NUM_EXPERTS = 128  # llama.cpp: use_kq_norm = type != 17B_128E
TensorReader = Callable[[GGUFTensorInfo, gguf.GGMLQuantizationType], np.ndarray]


def hf_config(metadata: Mapping[str, object], rope_factors: list[float] | None) -> dict[str, Any]:
    """The llama4_text config.json the GGUF's metadata (and its rope_freqs tensor) describe."""
    def get(key: str, default: object = None) -> Any:
        value = metadata.get(f"llama4.{key}", default)
        if value is None:
            raise UnsupportedCheckpointError(f"llama4 GGUF: no metadata llama4.{key}")
        return value

    num_layers, hidden = int(get("block_count")), int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_experts = int(get("expert_count", 0))
    step = int(get("interleave_moe_layer_step", 1))
    window = metadata.get("llama4.attention.sliding_window")
    chunk: int | None = LLAMA_CPP_CHUNK_SIZE if window is None else int(window) or None  # type: ignore[call-overload]
    pattern = metadata.get("llama4.attention.sliding_window_pattern")
    if chunk is None:
        uses_rope = [True] * num_layers
    elif isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise UnsupportedCheckpointError(
                f"llama4 GGUF: sliding_window_pattern names {len(pattern)} layers of {num_layers}")
        uses_rope = [bool(v) for v in pattern]
    else:
        uses_rope = [(i + 1) % LLAMA_CPP_NOPE_STEP != 0 for i in range(num_layers)]
    temperature_scale = float(get("attention.temperature_scale", LLAMA_CPP_TEMPERATURE[0]))
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(get("rope.freq_base", 500_000.0))}
    if rope_factors is not None:
        rope.update(rope_type="freq_factors", factors=rope_factors)
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    assert isinstance(tokens, list)
    return {
        "model_type": "llama4_text", "vocab_size": int(get("vocab_size", len(tokens))),
        "hidden_size": hidden, "intermediate_size_mlp": int(get("feed_forward_length")),
        "intermediate_size": int(get("expert_feed_forward_length", get("feed_forward_length"))),
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden // num_heads)),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": rope,
        "num_local_experts": num_experts, "num_experts_per_tok": int(get("expert_used_count", 1)),
        "interleave_moe_layer_step": step,
        "moe_layers": list(range(step - 1, num_layers, step)) if num_experts and step > 0 else [],
        "no_rope_layers": [int(v) for v in uses_rope], "attention_chunk_size": chunk,
        "use_qk_norm": num_experts != MAVERICK_NUM_EXPERTS,
        "attn_temperature_tuning": temperature_scale != 0 and chunk is not None,
        "attn_scale": temperature_scale,
        "floor_scale": int(get("attention.temperature_length", LLAMA_CPP_TEMPERATURE[1])),
    }


def hf_tensor_name(gguf_name: str) -> str:
    """The HF name of a llama4 GGUF tensor (stacked experts: see `_join_experts`); KeyError for
    one this engine does not read."""
    return hf_name_from_tables(gguf_name, _TOP, _MODULES, kinds=("weight",))


def load_llama4_gguf(path: Path, metadata: Mapping[str, object], infos: list[GGUFTensorInfo],
                     read: TensorReader, dtype: torch.dtype = torch.float32,
                     progress: bool = True) -> Checkpoint:
    from engine.loader.hf_checkpoint import model_config_from_fields

    def values_of(info: GGUFTensorInfo) -> np.ndarray:
        ggml_type = gguf.GGMLQuantizationType(info.ggml_type)
        return np.asarray(gguf.quants.dequantize(read(info, ggml_type), ggml_type),
                          dtype=np.float32)

    factors = next((values_of(i).tolist() for i in infos if i.name == "rope_freqs.weight"), None)
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    assert isinstance(tokens, list)
    eos, bos = (metadata.get("tokenizer.ggml.eos_token_id"),
                metadata.get("tokenizer.ggml.bos_token_id"))
    token_index = {token: i for i, token in enumerate(tokens)}
    model_config = dataclasses.replace(
        model_config_from_fields(hf_config(metadata, factors), model_id=path.stem),
        tie_word_embeddings="output.weight" not in {info.name for info in infos},
        eos_token_ids=collect_eos_token_ids([eos] if isinstance(eos, int) else [], token_index.get),
        bos_token_id=bos if isinstance(bos, int) else None)
    weights: dict[str, torch.Tensor] = {}
    for info in tqdm(infos, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        if info.name == "rope_freqs.weight":
            continue  # read above, into the config
        try:
            name = hf_tensor_name(info.name)
        except KeyError:
            raise UnsupportedCheckpointError(
                f"{path.name}: GGUF tensor {info.name!r} is not part of a llama4 model this "
                "engine reads") from None
        weights[name] = torch.from_numpy(np.ascontiguousarray(values_of(info))).to(dtype)
    _join_experts(weights)
    return Checkpoint(config=model_config, weights=weights, raw={})


def _join_experts(weights: dict[str, torch.Tensor]) -> None:
    """Stacked experts (module docstring) -> HF's fused Llama 4 layout, in place."""
    for gate_name in [n for n in weights if n.endswith(".experts.gate_proj.weight")]:
        # "model.layers.N.feed_forward.experts."
        prefix = gate_name.removesuffix("gate_proj.weight")
        gate, up = weights.pop(gate_name), weights.pop(prefix + "up_proj.weight", None)
        down = weights.pop(prefix + "down_proj.weight", None)
        if up is None or down is None:
            raise UnsupportedCheckpointError(
                f"llama4 GGUF: {gate_name} without its ffn_up_exps / ffn_down_exps")
        # 2 x [E, I, H] -> [E, 2I, H] -> [E, H, 2I];  [E, H, I] -> [E, I, H]
        weights[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=1).transpose(1, 2).contiguous()
        weights[prefix + "down_proj"] = down.transpose(1, 2).contiguous()
