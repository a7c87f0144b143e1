"""Tiny random gpt-oss checkpoints, written once per test session.

    dense   transformers' save_pretrained of a seeded random GptOssForCausalLM: 4 layers (sliding,
            full, sliding, full), sliding_window 8, YaRN as the released config has it (factor 32,
            beta 32/1, truncate off), 4 experts top-2, hidden 64, expert size 32, 4 query heads over
            2 kv heads of 16, large learned sinks; byte-level BPE tokenizer with the harmony
            specials
    mxfp4   the same model with its expert weights quantized to MXFP4 and stored as the released
            openai/gpt-oss-* files store them (*_blocks uint8 [E, N, K/32, 16], *_scales uint8
            [E, N, K/32], quantization_config.quant_method "mxfp4"); its reference is transformers'
            own reading of that directory (Mxfp4Config(dequantize=True))
    twin    the mxfp4 model's dequantized weights, written dense by save_pretrained
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.engine.models._checkpoints import add_gguf_vocabulary, finish_gguf, write_bpe_tokenizer

VOCAB_SIZE = 320
SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
            "<|call|>"]
SLIDING_WINDOW = 8
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]


def make_config(eos_id: int | None):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.GptOssConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=SLIDING_WINDOW, max_position_embeddings=64 * 32,
        initializer_range=0.3, rope_parameters=dict(YARN), eos_token_id=eos_id, pad_token_id=None,
        bos_token_id=None)


def write_tokenizer(directory: Path) -> int:
    """A byte-level BPE (vocab <= VOCAB_SIZE) as tokenizer.json + tokenizer_config.json; -> eos
    id."""
    return write_bpe_tokenizer(directory, SPECIALS, VOCAB_SIZE, eos_token="<|return|>",
                               pad_token="<|endoftext|>")["<|return|>"]


@dataclass
class GptOssCheckpoint:
    name: str
    directory: Path
    model: torch.nn.Module  # transformers' own reading, float32, eval mode


def quantize_experts(directory: Path) -> None:
    """Rewrite `directory`'s dense expert tensors as MXFP4 blocks + scales, config.json to match."""
    from safetensors.torch import load_file, save_file

    from engine.layers.mxfp4 import quantize_mxfp4

    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # [E, K, N] -> rows N
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": NOT_CONVERTED}
    (directory / "config.json").write_text(json.dumps(config))


def write_checkpoints(root: Path) -> dict[str, GptOssCheckpoint]:
    import transformers

    out = {}
    for name in ("dense", "mxfp4", "twin"):
        (root / name).mkdir()
    eos_id = write_tokenizer(root / "dense")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(eos_id), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks that take a visible share of each softmax
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model.eval().save_pretrained(root / "dense")
    out["dense"] = GptOssCheckpoint("dense", root / "dense", model)

    model.save_pretrained(root / "mxfp4")
    quantize_experts(root / "mxfp4")
    write_tokenizer(root / "mxfp4")
    dequantized = transformers.GptOssForCausalLM.from_pretrained(
        root / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32).eval()
    out["mxfp4"] = GptOssCheckpoint("mxfp4", root / "mxfp4", dequantized)
    dequantized.save_pretrained(root / "twin")
    config = json.loads((root / "twin" / "config.json").read_text())
    config.pop("quantization_config", None)
    (root / "twin" / "config.json").write_text(json.dumps(config))
    write_tokenizer(root / "twin")
    out["twin"] = GptOssCheckpoint("twin", root / "twin", dequantized)
    return out


@pytest.fixture(scope="session")
def gpt_oss_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GptOssCheckpoint]:
    torch.set_num_threads(1)
    return write_checkpoints(tmp_path_factory.mktemp("gpt_oss"))


# ---- GGUF, as llama.cpp's convert_hf_to_gguf lays out gpt-oss ------------------------------------
def hf_mxfp4_to_ggml(blocks: torch.Tensor, scales: torch.Tensor):  # type: ignore[no-untyped-def]
    """HF blocks [..., N, G, 16] + scales [..., N, G] -> GGML MXFP4 bytes [..., N, G * 17] (numpy):
    per group the scale byte, then values 0..15 in the low nibbles and 16..31 in the high ones."""
    # [..., G, 32] value order
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [..., G, 16]
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2).numpy()


def write_gguf(hf_directory: Path, path: Path) -> None:
    """The MXFP4 HF checkpoint as a gpt-oss GGUF (metadata, byte-level BPE vocabulary, tensors)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_directory / "config.json").read_text())
    tok = json.loads((hf_directory / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(YARN["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(YARN["factor"])
    writer.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])
    vocab = add_gguf_vocabulary(writer, tok, "gpt-4o", lambda t: t in SPECIALS)
    writer.add_eos_token_id(vocab["<|return|>"])

    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    modules = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
    tensors = load_file(str(hf_directory / "model.safetensors"))
    for name, tensor in sorted(tensors.items()):
        if name in names:
            writer.add_tensor(names[name], tensor.float().numpy())
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        blk = f"blk.{layer}."
        module, _, kind = rest.rpartition(".")
        if rest == "self_attn.sinks":
            writer.add_tensor(blk + "attn_sinks.weight", tensor.float().numpy())
        elif module in modules:
            writer.add_tensor(f"{blk}{modules[module]}.{kind}", tensor.float().numpy())
        elif rest == "mlp.experts.gate_up_proj_bias":  # interleaved gate/up -> two tensors
            writer.add_tensor(blk + "ffn_gate_exps.bias",
                              tensor[:, ::2].float().contiguous().numpy())
            writer.add_tensor(blk + "ffn_up_exps.bias",
                              tensor[:, 1::2].float().contiguous().numpy())
        elif rest == "mlp.experts.down_proj_bias":
            writer.add_tensor(blk + "ffn_down_exps.bias", tensor.float().numpy())
        elif rest == "mlp.experts.gate_up_proj_blocks":
            scales = tensors[name.replace("_blocks", "_scales")]
            for target, rows in (("ffn_gate_exps", slice(0, None, 2)),
                                 ("ffn_up_exps", slice(1, None, 2))):
                data = hf_mxfp4_to_ggml(tensor[:, rows].contiguous(), scales[:, rows].contiguous())
                writer.add_tensor(f"{blk}{target}.weight", data,
                                  raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif rest == "mlp.experts.down_proj_blocks":
            data = hf_mxfp4_to_ggml(tensor, tensors[name.replace("_blocks", "_scales")])
            writer.add_tensor(blk + "ffn_down_exps.weight", data,
                              raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif not rest.endswith("_scales"):
            raise AssertionError(f"no GGUF name for {name}")
    finish_gguf(writer)
