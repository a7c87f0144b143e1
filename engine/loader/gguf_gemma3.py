"""Gemma 3 text GGUF files (llama.cpp architecture `gemma3`) -> `Checkpoint` with the Hugging Face
`gemma3_text` names and layout, so the model is the one hf_gemma3.py configures.

Metadata `gemma3.*` -> config.json fields, with llama.cpp's own defaults where its converter writes
nothing (llama-model.cpp hard-codes them for the architecture):

    attention.sliding_window                  sliding_window
    attention.sliding_window_pattern          per layer, True = local (sliding) layer; absent:
                                              llama.cpp's pattern 6 (five local, then one global)
    rope.freq_base / rope.freq_base_swa       the global / local layers' bases (local absent:
                                              10,000)
    rope.scaling.type linear + factor         the global layers' scaling
    attention.key_length                      head_dim
    attention.scale                           query_pre_attn_scalar = scale ** -2, rounded to 1e-3;
                                              absent: llama.cpp's rule, hidden / heads for the 27B
                                              (62 layers), else head_dim
    final_logit_softcapping                   final_logit_softcapping

Tensors: llama.cpp stores Gemma's RMSNorm scales as 1 + w (the converter adds one to every
`*norm.weight`, q/k norms included), so one is subtracted here: w comes back to within float32
rounding of 1 + w (2 ** -24 for |w| < 1). attn_norm / post_attention_norm / ffn_norm /
post_ffw_norm are input_layernorm / post_attention_layernorm / pre_feedforward_layernorm /
post_feedforward_layernorm. Gemma's NEOX rope is stored unpermuted. The embedding is the lm head.
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
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_CPP_SWA_PATTERN = 6  # llama-model.cpp: gemma3's set_swa_pattern(6)
LLAMA_CPP_LOCAL_ROPE_BASE = 10_000.0  # llama-model.cpp: gemma3's rope_freq_base_train_swa
TensorReader = Callable[[GGUFTensorInfo, gguf.GGMLQuantizationType], np.ndarray]


def hf_config(metadata: Mapping[str, object]) -> dict[str, Any]:
    """The gemma3_text config.json the GGUF's metadata describes."""
    def get(key: str, default: object = None) -> Any:
        value = metadata.get(f"gemma3.{key}", default)
        if value is None:
            raise UnsupportedCheckpointError(f"gemma3 GGUF: no metadata gemma3.{key}")
        return value

    num_layers, hidden = int(get("block_count")), int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    pattern = metadata.get("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise UnsupportedCheckpointError(
                f"gemma3 GGUF: sliding_window_pattern names {len(pattern)} layers of {num_layers}")
        is_local = [bool(v) for v in pattern]
    else:
        step = int(pattern) if isinstance(pattern, int) and pattern > 0 else LLAMA_CPP_SWA_PATTERN
        is_local = [(i + 1) % step != 0 for i in range(num_layers)]
    scale = metadata.get("gemma3.attention.scale")
    if isinstance(scale, (int, float)) and scale > 0:
        query_pre_attn_scalar = round(float(scale) ** -2, 3)
    else:
        query_pre_attn_scalar = float(hidden // num_heads if num_layers == 62 else head_dim)
    full: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(get("rope.freq_base", 1_000_000.0))}
    scaling = metadata.get("gemma3.rope.scaling.type")
    if scaling == "linear":
        full.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise UnsupportedCheckpointError(f"gemma3 GGUF: rope scaling {scaling!r} is not supported "
                                         "(linear)")
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    assert isinstance(tokens, list)
    softcap = metadata.get("gemma3.final_logit_softcapping")
    return {
        "model_type": "gemma3_text", "vocab_size": int(get("vocab_size", len(tokens))),
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)), "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if local else "full_attention" for local in is_local],
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default",
            "rope_theta": float(get("rope.freq_base_swa", LLAMA_CPP_LOCAL_ROPE_BASE))}},
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "final_logit_softcapping": float(softcap) if isinstance(softcap, (int, float)) else None,
        "tie_word_embeddings": True,
    }


def hf_tensor_name(gguf_name: str) -> str:
    """The HF name of a gemma3 GGUF tensor; KeyError for one this engine does not read."""
    return hf_name_from_tables(gguf_name, _TOP, _MODULES, kinds=("weight",))


def load_gemma3_gguf(path: Path, metadata: Mapping[str, object], infos: list[GGUFTensorInfo],
                     read: TensorReader, dtype: torch.dtype = torch.float32,
                     progress: bool = True) -> Checkpoint:
    from engine.loader.hf_checkpoint import model_config_from_fields

    tokens = metadata.get("tokenizer.ggml.tokens") or []
    assert isinstance(tokens, list)
    eos, bos = (metadata.get("tokenizer.ggml.eos_token_id"),
                metadata.get("tokenizer.ggml.bos_token_id"))
    token_index = {token: i for i, token in enumerate(tokens)}
    names = {info.name for info in infos}
    model_config = dataclasses.replace(
        model_config_from_fields(hf_config(metadata), model_id=path.stem),
        tie_word_embeddings="output.weight" not in names,
        eos_token_ids=collect_eos_token_ids([eos] if isinstance(eos, int) else [], token_index.get),
        bos_token_id=bos if isinstance(bos, int) else None)
    weights: dict[str, torch.Tensor] = {}
    for info in tqdm(infos, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        try:
            name = hf_tensor_name(info.name)
        except KeyError:
            raise UnsupportedCheckpointError(
                f"{path.name}: GGUF tensor {info.name!r} is not part of a gemma3 model this "
                "engine reads") from None
        ggml_type = gguf.GGMLQuantizationType(info.ggml_type)
        values = np.asarray(gguf.quants.dequantize(read(info, ggml_type), ggml_type),
                            dtype=np.float32)
        if name.endswith("norm.weight"):
            values = values - np.float32(1)  # llama.cpp stores Gemma's 1 + w
        weights[name] = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    return Checkpoint(config=model_config, weights=weights, raw={})
