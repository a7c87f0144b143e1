"""Hugging Face directories (config.json + *.safetensors, sharded or not) -> `Checkpoint`.

config.json maps to `ModelConfig` for these `model_type`s (kept as `architecture`):

    llama, mistral    dense; attention_bias from the config (default False)
    qwen2             dense; q/k/v biases (attention_bias=True)
    mixtral           num_local_experts, num_experts_per_tok; expert size = intermediate_size;
                      top-k weights renormalised (norm_topk_prob=True)
    qwen2_moe         num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
                      shared_expert_intermediate_size; q/k/v biases (qkv_bias, default True);
                      decoder_sparse_step, mlp_only_layers (the dense MLP on the layers they
                      exclude)
    olmoe             num_experts, num_experts_per_tok; expert size = intermediate_size;
                      norm_topk_prob; qk_norm="projection"
    qwen3             dense; head_dim from the config; qk_norm="per_head"; attention_bias from the
                      config (default False)
    qwen3_moe         as qwen3, plus num_experts (or transformers 5's num_local_experts),
                      num_experts_per_tok, moe_intermediate_size, norm_topk_prob (default False),
                      decoder_sparse_step, mlp_only_layers; no shared expert
    gpt_oss           experts, layer_types + sliding_window, clamped SwiGLU, MXFP4 experts
                      (engine/loader/hf_gpt_oss.py)
    gemma3_text       local sliding layers between global ones, two rope bases, per-head q/k norm,
                      soft-capping (engine/loader/hf_gemma3.py)
    deepseek_v3       latent attention, grouped top-k routing, shared experts, dense first layers
                      (engine/loader/hf_deepseek_v3.py; also Kimi-K2's configs)
    llama4_text       RoPE layers with chunked local attention, NoPE global layers, interleaved
                      MoE with a shared expert (engine/loader/hf_llama4.py)
    llama4            the multimodal checkpoint's text model only, as llama4_text (kept as that)

Sliding windows: mistral and mixtral apply `sliding_window` to every layer, as transformers does
(absent: 4096 for mistral, none for mixtral; null: none); gpt_oss has `layer_types`. qwen3 and
qwen3_moe have a window only with `use_sliding_window` (the released models have it off); then, as
in transformers, qwen3 slides the layers its `layer_types` names (absent: layers >=
max_window_layers) and qwen3_moe every layer. Any other config that turns one on
(`use_sliding_window` with a `sliding_window`, or a "sliding_attention" in `layer_types`) is
refused.

rope: `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x); a "default"
rope type means no scaling. Tensor names stay as in the file; `raw` is empty but for a
block-scaled FP8 file's weights as stored (`RawFP8Blocks`). A block-scaled FP8
`quantization_config` (quant_method "fp8" with weight_block_size: DeepSeek-V3, Qwen3-*-FP8) is read
as stored and dequantized at load (engine/loader/fp8_blocks.py). Not mapped:
olmoe `clip_qkv`. A missing field a model_type needs, an unknown model_type or a refused setting
is one `UnsupportedCheckpointError` line.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from chat.special_tokens import as_id_list, collect_eos_token_ids
from engine.config import ModelConfig
from engine.loader.checkpoint import Checkpoint, UnsupportedCheckpointError
from engine.loader.fp8_blocks import FP8_DTYPES, dequantize_checkpoint, fp8_block_size

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                         "olmoe", "gpt_oss", "deepseek_v3", "gemma3_text", "llama4_text", "llama4")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _hashable(value: object) -> object:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _rope(config: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, object], ...] | None]:
    params = dict(config.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    if not params:
        params = dict(config.get("rope_scaling") or {})
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type") in (None, "default"):
        return theta, None
    return theta, tuple(sorted((k, _hashable(v)) for k, v in params.items()))


def _moe_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    model_type = config["model_type"]
    if model_type == "mixtral":
        return {"num_experts": config["num_local_experts"],
                "num_experts_per_tok": config["num_experts_per_tok"],
                "moe_intermediate_size": config["intermediate_size"], "norm_topk_prob": True}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        fields = {"num_experts": config.get("num_experts", config.get("num_local_experts")),
                  "num_experts_per_tok": config["num_experts_per_tok"],
                  "moe_intermediate_size": config["moe_intermediate_size"],
                  "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
                  "decoder_sparse_step": int(config.get("decoder_sparse_step") or 1),
                  "mlp_only_layers": tuple(int(i) for i in config.get("mlp_only_layers") or ())}
        if model_type == "qwen3_moe":
            return {**fields, "qk_norm": "per_head"}
        return {**fields, "attention_bias": bool(config.get("qkv_bias", True)),
                "shared_expert_intermediate_size": config.get("shared_expert_intermediate_size", 0)}
    if model_type == "olmoe":
        return {"num_experts": config["num_experts"],
                "num_experts_per_tok": config["num_experts_per_tok"],
                "moe_intermediate_size": config["intermediate_size"],
                "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
                "qk_norm": "projection"}
    if model_type == "qwen2":
        return {"attention_bias": True}
    if model_type == "qwen3":
        return {"qk_norm": "per_head"}
    if model_type == "gpt_oss":
        from engine.loader.hf_gpt_oss import gpt_oss_fields

        return gpt_oss_fields(config)
    if model_type == "deepseek_v3":
        from engine.loader.hf_deepseek_v3 import deepseek_v3_fields

        return deepseek_v3_fields(config)
    if model_type == "gemma3_text":
        from engine.loader.hf_gemma3 import gemma3_fields

        return gemma3_fields(config)
    if model_type == "llama4_text":
        from engine.loader.hf_llama4 import llama4_fields

        return llama4_fields(config)
    return {}


def _every_layer_window(config: Mapping[str, Any]) -> dict[str, Any]:
    """mistral / mixtral: one `sliding_window` for every layer (transformers' defaults when
    absent)."""
    window = config.get("sliding_window", 4096 if config["model_type"] == "mistral" else None)
    if window is None:
        return {}
    return {"sliding_window": int(window),
            "layer_types": ("sliding_attention",) * int(config["num_hidden_layers"])}


def _qwen3_windows(config: Mapping[str, Any]) -> dict[str, Any]:
    """qwen3 / qwen3_moe: transformers' sliding layers (module docstring)."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    if window is None:
        return {}
    num_layers = int(config["num_hidden_layers"])
    # Qwen3MoeAttention: config.sliding_window on every layer
    if config["model_type"] == "qwen3_moe":
        layer_types = ("sliding_attention",) * num_layers
    else:
        first_sliding = int(config.get("max_window_layers", 28))
        layer_types = tuple(config.get("layer_types") or [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(num_layers)])
    if "sliding_attention" not in layer_types:
        return {}
    return {"sliding_window": int(window), "layer_types": layer_types}


def _refuse_sliding_window(config: Mapping[str, Any]) -> None:
    """Raise for a config with a sliding window turned on (the engine attends to every position)."""
    window = config.get("sliding_window")
    sliding_layers = [i for i, kind in enumerate(config.get("layer_types") or [])
                      if kind == "sliding_attention"]
    if (config.get("use_sliding_window") and window) or sliding_layers:
        where = f"layers {sliding_layers}" if sliding_layers else "every layer"
        raise UnsupportedCheckpointError(
            f"{config['model_type']}: sliding-window attention (sliding_window={window}, on "
            f"{where}) is not supported for this model_type (only gpt_oss, mistral, mixtral, qwen3 "
            f"and qwen3_moe map their sliding layers)")


def _token_lookup(directory: Path) -> Any:
    """token -> id over tokenizer.json's vocab and added tokens (None if there is none)."""
    data = _read_json(directory / "tokenizer.json")
    vocab = dict((data.get("model") or {}).get("vocab") or {})
    if not isinstance(vocab, dict):  # unigram vocabularies are [token, score] lists
        vocab = {}
    for added in data.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    return vocab.get


def model_config_from_hf(directory: Path) -> ModelConfig:
    config = _read_json(directory / "config.json")
    try:
        return _model_config(directory, config)
    except KeyError as exc:  # a field the model_type needs
        raise UnsupportedCheckpointError(
            f"{directory / 'config.json'}: no {exc.args[0]!r} (model_type "
            f"{config.get('model_type')!r} needs it)") from None


def model_config_from_fields(config: Mapping[str, Any], model_id: str) -> ModelConfig:
    """The `ModelConfig` of a config.json's fields alone (no directory: no generation_config.json,
    eos ids only from `eos_token_id`); a GGUF loader that builds config.json fields uses it."""
    try:
        return dataclasses.replace(_model_config(Path("/nonexistent-model-directory"), config),
                                   model_id=model_id)
    except KeyError as exc:
        raise UnsupportedCheckpointError(
            f"no {exc.args[0]!r} (model_type {config.get('model_type')!r} needs it)") from None


def _model_config(directory: Path, config: Mapping[str, Any]) -> ModelConfig:
    model_type = config.get("model_type")
    if model_type == "llama4":  # the multimodal checkpoint's text model (hf_llama4.py)
        from engine.loader.hf_llama4 import text_config_of

        config = text_config_of(config)
        model_type = "llama4_text"
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedCheckpointError(
            f"model_type {model_type!r} is not supported (one of {SUPPORTED_MODEL_TYPES})")
    # those map their windows
    if model_type not in ("gpt_oss", "qwen3", "qwen3_moe", "gemma3_text"):
        _refuse_sliding_window(config)
    generation = _read_json(directory / "generation_config.json")
    num_heads = config["num_attention_heads"]
    rope_theta, rope_scaling = _rope(config)
    bos = as_id_list(generation.get("bos_token_id", config.get("bos_token_id")))
    declared_eos = (as_id_list(config.get("eos_token_id"))
                    + as_id_list(generation.get("eos_token_id")))
    fields: dict[str, Any] = {
        "attention_bias": bool(config.get("attention_bias", False)), **_moe_fields(config)}
    if model_type in ("mistral", "mixtral"):
        fields.update(_every_layer_window(config))
    if model_type in ("qwen3", "qwen3_moe"):
        fields.update(_qwen3_windows(config))
    num_kv_heads = (fields.pop("num_kv_heads", None) or config.get("num_key_value_heads")
                    or num_heads)
    head_dim = (fields.pop("head_dim", None) or config.get("head_dim")
                or config["hidden_size"] // num_heads)
    rope_theta = fields.pop("rope_theta", rope_theta)  # gemma3_text: the global layers' rope
    rope_scaling = fields.pop("rope_scaling", rope_scaling)
    tied = fields.pop("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)))
    return ModelConfig(
        architecture=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,  # deepseek_v3: the latent's one "kv head" (hf_deepseek_v3.py)
        head_dim=head_dim,
        max_position_embeddings=config["max_position_embeddings"],
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tied,
        eos_token_ids=collect_eos_token_ids(declared_eos, _token_lookup(directory)),
        bos_token_id=bos[0] if bos else None,
        model_id=directory.resolve().name,
        **fields,
    )


def load_hf_checkpoint(directory: Path, dtype: torch.dtype = torch.float32,
                       progress: bool = True) -> Checkpoint:
    config = model_config_from_hf(directory)
    raw_config = _read_json(directory / "config.json")
    fp8_block = fp8_block_size(raw_config)  # block-scaled FP8 files
    rename = _tensor_renamer(raw_config)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    with tqdm(desc=f"loading {directory.name}", unit="tensor", disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for stored_name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    name = rename(stored_name)
                    if name is None:
                        continue  # a part the engine does not run (llama4's vision tower)
                    tensor = f.get_tensor(stored_name)
                    as_stored = fp8_block is not None and tensor.dtype in FP8_DTYPES
                    keep = as_stored or not tensor.is_floating_point()
                    weights[name] = tensor if keep else tensor.to(dtype)
                    bar.update(1)
    raw = {}  # a block-scaled FP8 file's 2-D weights as stored (fp8_blocks.py)
    if fp8_block is not None:
        raw = dequantize_checkpoint(weights, fp8_block, dtype)  # the FP8 values as stored, scaled
    return Checkpoint(config=config, weights=weights, raw=raw)  # type: ignore[arg-type]


def _tensor_renamer(config: Mapping[str, Any]) -> Callable[[str], str | None]:
    """stored tensor name -> the model's name, or None for a tensor not read."""
    if config.get("model_type") == "llama4":
        from engine.loader.hf_llama4 import text_tensor_name

        return text_tensor_name
    return lambda name: name
