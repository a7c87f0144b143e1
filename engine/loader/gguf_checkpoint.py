"""Llama, Qwen3 and Qwen3-MoE GGUF files -> `Checkpoint` with Hugging Face names and layout
(gpt-oss files: gguf_gpt_oss.py; DeepSeek-V3's `deepseek2`: gguf_deepseek2.py; `gemma3`:
gguf_gemma3.py; `llama4`: gguf_llama4.py).

Config: `<arch>.*` metadata -> `ModelConfig`, arch = `general.architecture` ("llama", "qwen3",
"qwen3moe" -> architecture "llama", "qwen3", "qwen3_moe"); head_dim = embedding_length / head_count
unless `attention.key_length` is given; tie_word_embeddings when there is no `output.weight`.
qwen3*: per-head q/k norm (attn_q_norm / attn_k_norm); qwen3moe: expert_count, expert_used_count,
expert_feed_forward_length, every layer sparse, top-k weights renormalised (llama.cpp's qwen3moe
always does; `expert_weights_norm` when the file says), no sliding window (GGUF carries none).

Tensors: dequantized with `gguf.quants.dequantize`; GGUF names map to HF names (`_TENSOR_NAMES`).
qwen3moe's stacked experts ffn_gate_exps / ffn_up_exps [E, I, H] become transformers 5's fused
`mlp.experts.gate_up_proj` [E, 2I, H], ffn_down_exps [E, H, I] `mlp.experts.down_proj`; their
quantized blocks are kept per expert (`mlp.experts.{e}.gate_proj.weight`, ...) for the CPU default
path.

The q/k permutation (llama only: qwen3 uses GGML's NEOX RoPE, as HF, and is stored unpermuted).
llama.cpp's converter reorders the rows of q_proj and k_proj (weights and
biases) so that GGML's RoPE, which rotates adjacent pairs (x0, x1), (x2, x3)..., computes what HF's
`rotate_half`, which rotates (x_i, x_{i + d/2}), computes on the original rows:

    per head of d = head_dim rows:   GGUF row 2j   <- HF row j           (first half)
                                     GGUF row 2j+1 <- HF row j + d/2     (second half)

We undo it exactly as transformers does (`LlamaTensorProcessor._reverse_permute_weights`):

    w.reshape(num_heads, d/2, 2, in)  # GGUF: [head, pair j, member]
     .swapaxes(1, 2)                  # HF:   [head, half, j]
     .reshape(out, in)

with num_heads = head_count for q and head_count_kv for k. Quantized blocks run along the input
dim, so each output row is a whole number of blocks and the same row permutation applied to the
raw block bytes (`RawQuantized.data`, [out, bytes_per_row]) is exact.

`raw` holds every quantized 2-D weight: the seven linear projections of each layer (Q4_1 in
SmolLM2) and `model.embed_tokens.weight` (Q8_0 in SmolLM2), which is also the lm_head when
`tie_word_embeddings`. Norms are stored as F32 and have no raw entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from chat.gguf_metadata import GGUFTensorInfo, read_gguf_header
from chat.special_tokens import collect_eos_token_ids
from engine.config import ModelConfig
from engine.loader.checkpoint import Checkpoint, RawQuantized, UnsupportedCheckpointError
from engine.loader.gguf_names import hf_name_from_tables

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",  # fused at load
    "ffn_down_exps": "mlp.experts.down_proj",
}
_ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}  # GGUF -> ours
# Present in some llama GGUFs, derivable from the config; we skip them.
_SKIPPED_TENSORS = {"rope_freqs.weight"}
_NUMPY_ELEMENT_TYPES = {gguf.GGMLQuantizationType.F32: np.float32,
                        gguf.GGMLQuantizationType.F16: np.float16,
                        gguf.GGMLQuantizationType.F64: np.float64}
_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F64}


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; KeyError for a tensor we do not know."""
    return hf_name_from_tables(gguf_name, _TENSOR_NAMES, _LAYER_TENSOR_NAMES)


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (module docstring). `rows`: [out, ...], out = heads * d."""
    head_dim = rows.shape[0] // num_heads
    # [out, ...] -> [heads, d/2, 2, ...] -> [heads, 2, d/2, ...] -> [out, ...]
    grouped = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(rows.shape))


def model_config_from_gguf(metadata: Mapping[str, object], tensor_names: set[str],
                           model_id: str) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"GGUF architecture {arch!r} is not supported (one of {sorted(_ARCHITECTURES)}, "
            "gpt-oss, deepseek2, gemma3, llama4)")
    if arch == "llama" and metadata.get("llama.expert_count"):
        raise UnsupportedCheckpointError("llama-architecture MoE GGUF files (Mixtral) are not "
                                         "supported; use the HF directory")

    def number(key: str, default: float | None = None) -> float:
        value = metadata.get(f"{arch}.{key}", default)
        if not isinstance(value, (int, float)):
            raise ValueError(f"GGUF metadata {arch}.{key} is missing or not a number: {value!r}")
        return value

    def count(key: str, default: int | None = None) -> int:
        return int(number(key, default))

    tokens = metadata.get("tokenizer.ggml.tokens") or []
    assert isinstance(tokens, list)
    hidden, num_heads = count("embedding_length"), count("attention.head_count")
    rope_scaling = None
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        items: dict[str, object] = {"rope_type": scaling, "factor": number("rope.scaling.factor")}
        if metadata.get(f"{arch}.rope.scaling.original_context_length"):
            items["original_max_position_embeddings"] = count(
                "rope.scaling.original_context_length")
        rope_scaling = tuple(sorted(items.items()))
    token_index = {token: i for i, token in enumerate(tokens)}
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    experts: dict[str, object] = {}
    if arch == "qwen3moe":
        experts = {"num_experts": count("expert_count"),
                   "num_experts_per_tok": count("expert_used_count"),
                   "moe_intermediate_size": count("expert_feed_forward_length"),
                   "norm_topk_prob": bool(metadata.get("qwen3moe.expert_weights_norm", True))}
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=count("vocab_size", len(tokens)),
        hidden_size=hidden,
        intermediate_size=count("feed_forward_length", 0 if experts else None),
        num_layers=count("block_count"),
        num_heads=num_heads,
        num_kv_heads=count("attention.head_count_kv", num_heads),
        head_dim=count("attention.key_length", hidden // num_heads),
        max_position_embeddings=count("context_length"),
        rms_norm_eps=float(number("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(number("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        eos_token_ids=collect_eos_token_ids([eos] if isinstance(eos, int) else [],
                                            token_index.get),
        bos_token_id=bos if isinstance(bos, int) else None,
        model_id=model_id,
        qk_norm="per_head" if arch in ("qwen3", "qwen3moe") else None,
        **experts,  # type: ignore[arg-type]
    )


def load_gguf_checkpoint(path: Path, dtype: torch.dtype = torch.float32,
                         progress: bool = True) -> Checkpoint:
    metadata, infos = read_gguf_header(path)
    if metadata.get("general.architecture") == "deepseek2":  # engine/loader/gguf_deepseek2.py
        from engine.loader.gguf_deepseek2 import load_deepseek2_gguf

        file_view = np.memmap(path, dtype=np.uint8, mode="r")
        return load_deepseek2_gguf(path, metadata, infos,
                                   lambda info, ggml_type: _tensor_data(file_view, info, ggml_type),
                                   dtype=dtype, progress=progress)
    # gguf_gemma3.py, gguf_llama4.py
    if metadata.get("general.architecture") in ("gemma3", "llama4"):
        from engine.loader.gguf_gemma3 import load_gemma3_gguf
        from engine.loader.gguf_llama4 import load_llama4_gguf

        file_view = np.memmap(path, dtype=np.uint8, mode="r")
        load = (load_gemma3_gguf if metadata["general.architecture"] == "gemma3"
                else load_llama4_gguf)
        return load(path, metadata, infos,
                    lambda info, ggml_type: _tensor_data(file_view, info, ggml_type),
                    dtype=dtype, progress=progress)
    if metadata.get("general.architecture") == "gpt-oss":  # engine/loader/gguf_gpt_oss.py
        from engine.loader.gguf_gpt_oss import load_gpt_oss_gguf

        file_view = np.memmap(path, dtype=np.uint8, mode="r")
        return load_gpt_oss_gguf(path, metadata, infos,
                                 lambda info, ggml_type: _tensor_data(file_view, info, ggml_type),
                                 dtype=dtype, progress=progress)
    config = model_config_from_gguf(metadata, {t.name for t in infos}, path.stem)
    heads_by_module = ({"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
                       if config.architecture == "llama" else {})  # qwen3: NEOX rope, unpermuted
    file_bytes = np.memmap(path, dtype=np.uint8, mode="r")

    weights: dict[str, torch.Tensor] = {}
    raw: dict[str, RawQuantized] = {}
    for info in tqdm(infos, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        if info.name in _SKIPPED_TENSORS:
            continue
        try:
            name = hf_tensor_name(info.name)
        except KeyError:
            raise UnsupportedCheckpointError(
                f"{path.name}: GGUF tensor {info.name!r} is not part of a {config.architecture} "
                "model this engine reads") from None
        ggml_type = gguf.GGMLQuantizationType(info.ggml_type)
        # A plain array (not a memmap view): gguf's dequantize is ~10x slower on memmap slices.
        data = _tensor_data(file_bytes, info, ggml_type)
        values = gguf.quants.dequantize(data, ggml_type)
        blocks = None if ggml_type in _FLOAT_TYPES else data
        module = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        if module in heads_by_module:
            values = unpermute_rope_rows(values, heads_by_module[module])
            if blocks is not None:
                blocks = unpermute_rope_rows(blocks, heads_by_module[module])
        weights[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)
        if blocks is not None and values.ndim == 2:
            out_features, in_features = values.shape
            raw[name] = RawQuantized(ggml_type=ggml_type.name,
                                     shape=(out_features, in_features), data=blocks)
        elif blocks is not None and values.ndim == 3 and ".mlp.experts." in name:
            raw.update(_expert_blocks(name, ggml_type.name, values.shape, blocks))
    _fuse_stacked_experts(weights)
    return Checkpoint(config=config, weights=weights, raw=raw)


def _expert_blocks(name: str, ggml_type: str, shape: tuple[int, ...], blocks: np.ndarray
                   ) -> dict[str, RawQuantized]:
    """A stacked expert tensor's blocks [E, out, bytes_per_row] -> one RawQuantized per expert,
    named `...mlp.experts.{e}.gate_proj.weight` (the CPU default path's per-expert linears read
    them: engine/layers/native_experts.py)."""
    num_experts, out_features, in_features = shape
    per_expert = name.replace(".mlp.experts.", ".mlp.experts.{}.")
    return {per_expert.format(e): RawQuantized(ggml_type=ggml_type,
                                               shape=(out_features, in_features),
                                               data=np.ascontiguousarray(blocks[e]))
            for e in range(num_experts)}


def _fuse_stacked_experts(weights: dict[str, torch.Tensor]) -> None:
    """Stacked expert tensors (module docstring) -> the fused experts layout, in place."""
    for gate_name in [n for n in weights if n.endswith(".mlp.experts.gate_proj.weight")]:
        prefix = gate_name.removesuffix("gate_proj.weight")  # "model.layers.N.mlp.experts."
        gate, up = weights.pop(gate_name), weights.pop(prefix + "up_proj.weight", None)
        if up is None:
            raise ValueError(f"GGUF has {gate_name!r} but no {prefix}up_proj.weight (ffn_up_exps)")
        # 2 x [E, I, H] -> [E, 2I, H]
        weights[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        down = weights.pop(prefix + "down_proj.weight", None)
        if down is not None:
            weights[prefix + "down_proj"] = down  # [E, H, I]


def _tensor_data(file_bytes: np.ndarray, info: GGUFTensorInfo,
                 ggml_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """The tensor's bytes as gguf lays them out: elements for float types, [rows..., row bytes]
    else."""
    element_type = _NUMPY_ELEMENT_TYPES.get(ggml_type)
    if element_type is not None:
        item = np.dtype(element_type)
        count = int(np.prod(info.shape))
        raw = np.array(file_bytes[info.data_offset:info.data_offset + count * item.itemsize])
        return raw.view(item).reshape(info.shape)
    byte_shape = gguf.quant_shape_to_byte_shape(info.shape, ggml_type)
    num_bytes = int(np.prod(byte_shape))
    return np.array(file_bytes[info.data_offset:info.data_offset + num_bytes]).reshape(byte_shape)
