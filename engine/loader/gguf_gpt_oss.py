"""gpt-oss GGUF files (llama.cpp's `general.architecture` "gpt-oss") -> `Checkpoint` in the layout
of the released Hugging Face directories, so engine/models/gpt_oss.py loads both the same way.

Config (`gpt-oss.*` metadata, as llama.cpp's convert_hf_to_gguf writes it): experts from
expert_count / expert_used_count / expert_feed_forward_length, the window from
attention.sliding_window on the even layers (llama.cpp's gpt-oss: sliding, full, sliding, ...),
YaRN from rope.scaling.* (beta_fast / beta_slow when the file has them, else the released config's
32 / 1; truncate off, as released), the clamped SwiGLU at its defaults (alpha 1.702, limit 7).

Tensors (`N` a layer; GGUF -> HF, `p` = "model.layers.N."):

    blk.N.attn_{q,k,v,output}.{weight,bias}   p.self_attn.{q,k,v,o}_proj.* (NEOX rope: not permuted)
    blk.N.attn_sinks.weight                   p.self_attn.sinks
    blk.N.attn_norm / post_attention_norm     p.input_layernorm / p.post_attention_layernorm
    blk.N.ffn_gate_inp.{weight,bias}          p.mlp.router.*
    blk.N.ffn_{gate,up}_exps.{weight,bias}    p.mlp.experts.gate_up_proj_{blocks,scales,bias}: gate
                                              and up rows interleaved again, as the HF files have
                                              them
    blk.N.ffn_down_exps.{weight,bias}         p.mlp.experts.down_proj_{blocks,scales,bias}

GGML's MXFP4 block (17 bytes a 32-value group): the e8m0 scale byte, then 16 bytes whose low nibbles
are values 0..15 and high nibbles 16..31 (its e2m1 table is doubled and its scale halved: the same
products). The HF layout (engine/layers/mxfp4.py) packs values 2j, 2j + 1 into byte j; the scale
byte is the same. Expert tensors of any other type are dequantized and stored as HF's dense
gate_up_proj [E, H, 2I] / down_proj [E, I, H].
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from chat.special_tokens import collect_eos_token_ids
from engine.config import ModelConfig
from engine.loader.checkpoint import Checkpoint, UnsupportedCheckpointError

ARCH = "gpt-oss"
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F64}


def gpt_oss_config_from_gguf(metadata: Mapping[str, object], model_id: str) -> ModelConfig:
    def number(key: str, default: float | None = None) -> float:
        value = metadata.get(f"{ARCH}.{key}", default)
        if not isinstance(value, (int, float)):
            raise ValueError(f"GGUF metadata {ARCH}.{key} is missing or not a number: {value!r}")
        return value

    def count(key: str, default: int | None = None) -> int:
        return int(number(key, default))

    tokens = metadata.get("tokenizer.ggml.tokens") or []
    assert isinstance(tokens, list)
    num_layers, hidden, num_heads = (count("block_count"), count("embedding_length"),
                                     count("attention.head_count"))
    rope_scaling = None
    if metadata.get(f"{ARCH}.rope.scaling.type") == "yarn":
        rope_scaling = tuple(sorted({
            "rope_type": "yarn", "factor": number("rope.scaling.factor"),
            "beta_fast": float(number("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(number("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False,
            "original_max_position_embeddings": count(
                "rope.scaling.original_context_length")}.items()))
    elif metadata.get(f"{ARCH}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedCheckpointError(f"GGUF {ARCH}.rope.scaling.type "
                                         f"{metadata.get(f'{ARCH}.rope.scaling.type')!r} "
                         "is not supported (yarn)")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    token_index = {token: i for i, token in enumerate(tokens)}
    expert_size = count("expert_feed_forward_length")
    return ModelConfig(
        architecture="gpt_oss", vocab_size=count("vocab_size", len(tokens)), hidden_size=hidden,
        intermediate_size=expert_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=count("attention.head_count_kv", num_heads),
        head_dim=count("attention.key_length", hidden // num_heads),
        max_position_embeddings=count("context_length"),
        rms_norm_eps=float(number("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(number("rope.freq_base", 150000.0)), rope_scaling=rope_scaling,
        attention_bias=True, num_experts=count("expert_count"),
        num_experts_per_tok=count("expert_used_count"), moe_intermediate_size=expert_size,
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(num_layers)),
        sliding_window=count("attention.sliding_window"),
        eos_token_ids=collect_eos_token_ids([eos] if isinstance(eos, int) else [], token_index.get),
        bos_token_id=bos if isinstance(bos, int) else None, model_id=model_id)


def ggml_mxfp4_to_hf(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML MXFP4 bytes [..., N, G * 17] -> (blocks uint8 [..., N, G, 16], scales uint8 [..., N,
    G])."""
    groups = torch.from_numpy(np.ascontiguousarray(data)).unflatten(-1, (-1, 17))  # [..., G, 17]
    scales, packed = groups[..., 0], groups[..., 1:]  # [..., G], [..., G, 16]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # [..., G, 32] in value order
    pairs = codes.unflatten(-1, (16, 2))  # values (2j, 2j + 1)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous(), scales.contiguous()


def _interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [E, I, ...] -> [E, 2I, ...] with rows gate0, up0, gate1, up1, ... (HF's order)."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def load_gpt_oss_gguf(path: Path, metadata: Mapping[str, object], infos: list, read_tensor,  # type: ignore[no-untyped-def]
                      dtype: torch.dtype = torch.float32, progress: bool = True) -> Checkpoint:
    """`read_tensor(info, ggml_type)` returns the tensor's bytes as gguf lays them out
    (gguf_checkpoint._tensor_data)."""
    config = gpt_oss_config_from_gguf(metadata, path.stem)
    weights: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, str], object] = {}  # (layer, gguf module, weight|bias) -> data
    for info in tqdm(infos, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        ggml_type = gguf.GGMLQuantizationType(info.ggml_type)
        data = read_tensor(info, ggml_type)
        if info.name in _GLOBAL_NAMES:
            weights[_GLOBAL_NAMES[info.name]] = _float(data, ggml_type, dtype)
            continue
        parts = info.name.split(".")
        if len(parts) != 4 or parts[0] != "blk":
            raise ValueError(f"GGUF tensor {info.name!r} is not one gpt-oss has")
        layer, module, kind = int(parts[1]), parts[2], parts[3]
        p = f"model.layers.{layer}."
        if module in _EXPERTS:
            experts[(layer, module, kind)] = (data, ggml_type)
        elif module == "attn_sinks":
            weights[p + "self_attn.sinks"] = _float(data, ggml_type, dtype)
        elif module in _LAYER_NAMES:
            weights[f"{p}{_LAYER_NAMES[module]}.{kind}"] = _float(data, ggml_type, dtype)
        else:
            raise ValueError(f"GGUF tensor {info.name!r} is not one gpt-oss has")
    for layer in range(config.num_layers):
        weights |= _layer_experts(experts, layer, dtype)
    return Checkpoint(config=config, weights=weights, raw={})


def _layer_experts(experts: dict, layer: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    p = f"model.layers.{layer}.mlp.experts."

    def get(module: str, kind: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        found = experts.get((layer, module, kind))
        if found is None:
            raise ValueError(f"GGUF has no tensor 'blk.{layer}.{module}.{kind}'")
        return found  # type: ignore[no-any-return]

    out: dict[str, torch.Tensor] = {}
    gate_bias, up_bias = (_float(*get(m, "bias"), dtype) for m in ("ffn_gate_exps", "ffn_up_exps"))
    out[p + "gate_up_proj_bias"] = _interleave_rows(gate_bias, up_bias)  # [E, 2I]
    out[p + "down_proj_bias"] = _float(*get("ffn_down_exps", "bias"), dtype)  # [E, H]
    (gate, gate_type), (up, up_type), (down, down_type) = (get(m, "weight") for m in _EXPERTS)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    if gate_type == up_type == down_type == mxfp4:
        (gate_b, gate_s), (up_b, up_s) = ggml_mxfp4_to_hf(gate), ggml_mxfp4_to_hf(up)
        out[p + "gate_up_proj_blocks"] = _interleave_rows(gate_b, up_b)  # [E, 2I, G, 16]
        out[p + "gate_up_proj_scales"] = _interleave_rows(gate_s, up_s)  # [E, 2I, G]
        out[p + "down_proj_blocks"], out[p + "down_proj_scales"] = ggml_mxfp4_to_hf(down)
    else:  # dense: HF's [E, H, 2I] and [E, I, H]
        # [E, 2I, H]
        w13 = _interleave_rows(_float(gate, gate_type, dtype), _float(up, up_type, dtype))
        out[p + "gate_up_proj"] = w13.transpose(1, 2).contiguous()
        out[p + "down_proj"] = _float(down, down_type, dtype).transpose(1, 2).contiguous()
    return out


def _float(data: np.ndarray, ggml_type: gguf.GGMLQuantizationType,
           dtype: torch.dtype) -> torch.Tensor:
    values = (data if ggml_type in _FLOAT_TYPES and data.dtype != np.uint8
              else gguf.quants.dequantize(data, ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)
