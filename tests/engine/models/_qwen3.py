"""Tiny random Qwen3 / Qwen3-MoE checkpoints written by transformers' save_pretrained, with a small
byte-level BPE tokenizer (ChatML specials), once per test session.

Variants (each a directory under one session tmp dir):
    qwen3              dense; head_dim 32 != hidden / heads (16); tied embeddings
    qwen3_moe          8 experts, top-2, norm_topk_prob on, mlp_only_layers [1]: layers 0, 2 sparse
    qwen3_moe-step2    8 experts, top-2, norm_topk_prob off, decoder_sparse_step 2: layers 1, 3
                       sparse
    qwen3_moe-sparse   2 layers, both sparse (what a qwen3moe GGUF can hold), norm_topk_prob on
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.engine.models._checkpoints import (
    add_gguf_vocabulary,
    finish_gguf,
    randomize_norms,
    write_bpe_tokenizer,
)

VOCAB_SIZE = 320  # the tokenizer's 256 bytes + merges + 3 specials fit in it
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
              initializer_range=0.3, rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=None)


def make_config(name: str, eos_id: int | None = None):  # type: ignore[no-untyped-def]
    """The transformers config of variant `name` (module docstring)."""
    import transformers

    if name == "qwen3":
        return transformers.Qwen3Config(**COMMON, num_hidden_layers=2, eos_token_id=eos_id,
                                        tie_word_embeddings=True)
    moe = dict(COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               eos_token_id=eos_id, tie_word_embeddings=False)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**moe, num_hidden_layers=3, norm_topk_prob=True,
                                           mlp_only_layers=[1])
    if name == "qwen3_moe-sparse":
        return transformers.Qwen3MoeConfig(**moe, num_hidden_layers=2, norm_topk_prob=True)
    assert name == "qwen3_moe-step2"
    return transformers.Qwen3MoeConfig(**moe, num_hidden_layers=4, norm_topk_prob=False,
                                       decoder_sparse_step=2)


VARIANTS = ("qwen3", "qwen3_moe", "qwen3_moe-step2")


def write_tokenizer(directory: Path) -> int:
    """A byte-level BPE (vocab <= VOCAB_SIZE) as tokenizer.json + tokenizer_config.json; -> eos
    id."""
    return write_bpe_tokenizer(directory, SPECIALS, VOCAB_SIZE, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", chat_template=CHATML)["<|im_end|>"]


@dataclass
class TinyCheckpoint:
    name: str
    directory: Path
    model: torch.nn.Module  # transformers' own, float32, eval mode


def write_checkpoints(root: Path, names: tuple[str, ...] = VARIANTS) -> dict[str, TinyCheckpoint]:
    import transformers

    out = {}
    for name in names:
        directory = root / name
        directory.mkdir()
        config = make_config(name, eos_id=write_tokenizer(directory))
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        randomize_norms(model, 1.0)  # norms start at 1
        model.save_pretrained(directory)
        out[name] = TinyCheckpoint(name, directory, model)
    return out


@pytest.fixture(scope="session")
def qwen3_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyCheckpoint]:
    return write_checkpoints(tmp_path_factory.mktemp("qwen3"))


# ---- GGUF, as llama.cpp's convert_hf_to_gguf lays out qwen3 / qwen3moe ---------------------------
_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_GGUF_MODULES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}


def write_gguf(hf_directory: Path, path: Path, linear_type: str = "F32",
               extra_tensors: dict[str, torch.Tensor] | None = None,
               expert_type: str = "F32") -> None:
    """The HF checkpoint as a qwen3 / qwen3moe GGUF: metadata, the byte-level BPE vocabulary,
    tensors (q/k not permuted: NEOX rope); per-expert tensors stacked into ffn_{gate,up,down}_exps.
    2-D projection weights in `linear_type` ("F32", "Q8_0" or "Q4_0"; norms stay F32), the stacked
    experts in `expert_type`."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_directory / "config.json").read_text())
    arch = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[config["model_type"]]
    tok = json.loads((hf_directory / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if arch == "qwen3moe":
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    vocab = add_gguf_vocabulary(writer, tok, "qwen2", lambda t: t.startswith("<|"),
                                config["vocab_size"])
    writer.add_eos_token_id(vocab["<|im_end|>"])

    def add(name: str, tensor: torch.Tensor, quantize: bool, block_type: str = linear_type) -> None:
        values = tensor.float().numpy()
        qtype = gguf.GGMLQuantizationType[block_type if quantize else "F32"]
        if qtype != gguf.GGMLQuantizationType.F32:
            values = gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, values, raw_dtype=qtype)

    tensors = load_file(str(hf_directory / "model.safetensors"))
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in sorted(tensors.items()):
        if name in _GGUF_NAMES:
            add(_GGUF_NAMES[name], tensor, quantize=True)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        module, _, kind = rest.rpartition(".")
        if module.startswith("mlp.experts."):  # mlp.experts.{e}.{gate,up,down}_proj
            _, _, expert, proj = module.split(".")
            experts.setdefault(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", {})[
                int(expert)] = tensor
        else:
            add(f"blk.{layer}.{_GGUF_MODULES[module]}.{kind}", tensor,
                quantize=tensor.dim() == 2 and module != "mlp.gate")
    for name, by_expert in experts.items():
        add(name, torch.stack([by_expert[e] for e in sorted(by_expert)]), quantize=True,
            block_type=expert_type)  # [E, out, in]
    for name, tensor in (extra_tensors or {}).items():
        add(name, tensor, quantize=False)
    finish_gguf(writer)
