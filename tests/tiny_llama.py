"""A tiny random Llama checkpoint with the default model's tokenizer, for tests that start real
replica processes and need only that they serve (not what they say): it loads in milliseconds,
where the default GGUF took up to ~65 s on the loaded 2-core VM."""

from __future__ import annotations

import json
from pathlib import Path


def write_tiny_llama(directory: Path) -> Path:
    """Write a random Llama of 2 layers (hidden 64) with SmolLM2's tokenizer and chat template
    into `directory` (safetensors + config.json + tokenizer.json, no transformers import, ~1 s
    once torch is imported); returns it."""
    import torch
    from safetensors.torch import save_file

    from chat.gguf_metadata import read_gguf_metadata
    from chat.gguf_vocab import build_gguf_tokenizer
    from contracts.default_model import default_model_path

    hidden, inner, layers, heads, kv_heads, vocab = 64, 128, 2, 4, 2, 49152
    head_dim = hidden // heads
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    weights = {"model.embed_tokens.weight": rand(vocab, hidden),
               "lm_head.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        weights.update({
            prefix + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": rand(inner, hidden),
            prefix + "mlp.up_proj.weight": rand(inner, hidden),
            prefix + "mlp.down_proj.weight": rand(hidden, inner),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden)})
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inner, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}))
    metadata = read_gguf_metadata(default_model_path())
    backend = build_gguf_tokenizer(metadata)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": metadata["tokenizer.chat_template"], "bos_token": backend.id_to_token(1),
        "eos_token": backend.id_to_token(2)}))
    return directory
