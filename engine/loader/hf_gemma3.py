"""gemma3_text config.json -> `ModelConfig` fields (read by hf_checkpoint.py), as transformers'
Gemma3TextConfig reads it (4.x and 5.x files):

    layer_types, sliding_window          "sliding_attention" / "full_attention" per layer; absent:
                                         layer i slides unless (i + 1) % sliding_window_pattern == 0
                                         (default 6: five local layers, then one global)
    rope_parameters (5.x)                {"full_attention": {rope_theta, rope_type, factor...},
                                          "sliding_attention": {rope_theta, ...}}
    rope_theta + rope_scaling (4.x)      the global layers' base and scaling (default 1e6, none);
    rope_local_base_freq                 the local layers' base (default 1e4, never scaled)
    query_pre_attn_scalar (256)          softmax scale query_pre_attn_scalar ** -0.5
    final_logit_softcapping              logits = c * tanh(logits / c) (null: off)
    attn_logit_softcapping               refused when set: no attention backend soft-caps scores
    hidden_activation                    only gelu_pytorch_tanh (GeGLU), what Gemma 3 ships
    use_bidirectional_attention          refused when true (an embedding model's setting)
    attention_bias                       refused when true (Gemma 3 has no projection biases)
    tie_word_embeddings (default True)   the lm head is the embedding

Multimodal `gemma3` checkpoints (Gemma3ForConditionalGeneration, a `text_config` inside) are not
mapped: their model_type is refused by hf_checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import GemmaConfig
from engine.loader.checkpoint import UnsupportedCheckpointError


def _hashable(value: object) -> object:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _ropes(config: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, object], ...] | None, float]:
    """-> (global rope_theta, global rope scaling as sorted items or None, local rope_theta)."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # 4.x: flat fields
        full = dict(config.get("rope_scaling") or {})
        full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    if "type" in full:
        full.setdefault("rope_type", full.pop("type"))
    if local.get("rope_type", "default") != "default":
        raise UnsupportedCheckpointError(
            f"gemma3_text: scaled rope on the sliding layers ({local['rope_type']!r}) is not "
            "supported")
    theta = float(full.pop("rope_theta", 1_000_000.0))
    scaling = None
    if full.get("rope_type") not in (None, "default"):
        scaling = tuple(sorted((k, _hashable(v)) for k, v in full.items()))
    return theta, scaling, float(local.get("rope_theta", 10_000.0))


def gemma3_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    for name, refused in (("attn_logit_softcapping", None), ("use_bidirectional_attention", False),
                          ("attention_bias", False)):
        value = config.get(name) or refused
        if value != refused:
            why = ("the attention backends do not soft-cap scores"
                   if name == "attn_logit_softcapping"
                   else "Gemma 3 causal LMs have it off")
            raise UnsupportedCheckpointError(f"gemma3_text: {name}={value!r} is not supported "
                                             f"({why})")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedCheckpointError(
            f"gemma3_text: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    num_layers = int(config["num_hidden_layers"])
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
                  or 6)
    layer_types = tuple(config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)])
    window = config.get("sliding_window", 4096)
    if window is None:  # no window: every layer attends to the whole context
        layer_types = ("full_attention",) * num_layers
    theta, scaling, local_theta = _ropes(config)
    softcap = config.get("final_logit_softcapping")
    fields: dict[str, Any] = {
        "rope_theta": theta, "rope_scaling": scaling,
        "layer_types": layer_types, "sliding_window": int(window) if window is not None else None,
        "qk_norm": "per_head",
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
        "gemma": GemmaConfig(local_rope_theta=local_theta,
                             query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
                             final_logit_softcapping=float(softcap) if softcap else None)}
    if "sliding_attention" not in layer_types:
        fields.update(layer_types=None, sliding_window=None)
    return fields
