"""A deepseek2 GGUF (llama.cpp's architecture for DeepSeek-V3 / R1), written here from the tiny
transformers checkpoint as llama.cpp's convert_hf_to_gguf lays it out (MLA metadata with
head_count_kv 1, kv_b_proj split into attn_k_b (transposed) / attn_v_b, stacked experts, the MTP
layer left out), loads to the HF directory's config and weights and generates transformers'
tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import pytest
import torch

from chat.gguf_metadata import read_gguf_header
from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.loader import load_checkpoint
from tests.engine.fakes import assert_idle_and_clean, generate
from tests.engine.models._checkpoints import add_gguf_vocabulary, finish_gguf
from tests.engine.models._deepseek_v3 import DeepseekCheckpoint
from tests.engine.models._greedy import hf_greedy

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11, 12, 13, 200, 31, 64]
_TOP = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
        "lm_head.weight": "output"}
_MODULES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
            "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
            "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
            "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
            "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
            "mlp.shared_experts.up_proj": "ffn_up_shexp",
            "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def write_deepseek2_gguf(directory: Path, path: Path) -> None:
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    rope = config["rope_parameters"]
    tok = json.loads((directory / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(1)  # MLA: one latent "head"
    rank, rope_dims = config["kv_lora_rank"], config["qk_rope_head_dim"]
    w.add_key_length(rank + rope_dims)
    w.add_value_length(rank)
    w.add_key_length_mla(config["qk_nope_head_dim"] + rope_dims)
    w.add_value_length_mla(config["v_head_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_leading_dense_block_count(config["first_k_dense_replace"])
    if config.get("q_lora_rank"):
        w.add_q_lora_rank(config["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_expert_count(config["n_routed_experts"])
    w.add_expert_shared_count(config["n_shared_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_weights_scale(config["routed_scaling_factor"])
    w.add_expert_weights_norm(config["norm_topk_prob"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(config["n_group"])
    w.add_expert_group_used_count(config["topk_group"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    add_gguf_vocabulary(w, tok, "qwen2", lambda t: t.startswith("<|"), config["vocab_size"])
    w.add_eos_token_id(config["eos_token_id"])

    def add(name: str, tensor: torch.Tensor) -> None:
        w.add_tensor(name, tensor.float().contiguous().numpy())

    heads, nope, v_dim = (config["num_attention_heads"], config["qk_nope_head_dim"],
                          config["v_head_dim"])
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in sorted(load_file(str(directory / "model.safetensors")).items()):
        if name in _TOP:
            add(_TOP[name] + ".weight", tensor)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if int(layer) >= config["num_hidden_layers"]:
            continue  # the MTP layer
        blk = f"blk.{layer}."
        if rest == "self_attn.kv_b_proj.weight":  # [H * (nope + v), R] -> k_b^T, v_b
            k_b, v_b = tensor.view(heads, nope + v_dim, rank).split([nope, v_dim], dim=1)
            add(blk + "attn_k_b.weight", k_b.transpose(1, 2))
            add(blk + "attn_v_b.weight", v_b)
        elif rest.startswith("mlp.experts."):  # mlp.experts.{e}.{gate,up,down}_proj.weight
            _, _, expert, proj, _ = rest.split(".")
            experts.setdefault(f"{blk}ffn_{proj.removesuffix('_proj')}_exps.weight", {})[
                int(expert)] = tensor
        elif rest == "mlp.gate.e_score_correction_bias":
            add(blk + "exp_probs_b.bias", tensor)
        else:
            module, _, kind = rest.rpartition(".")
            add(f"{blk}{_MODULES[module]}.{kind}", tensor)
    for name, by_expert in experts.items():  # stacked [E, out, in]
        add(name, torch.stack([by_expert[e] for e in sorted(by_expert)]))
    finish_gguf(w)


def test_deepseek2_gguf_loads_as_the_hf_directory_and_generates_transformers_tokens(
        deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint], tmp_path: Path) -> None:
    source = deepseek_v3_checkpoints["lora"]
    path = tmp_path / "deepseek-v3-tiny.gguf"
    write_deepseek2_gguf(source.directory, path)
    known = {gguf.TENSOR_NAMES[t].format(bid=i) + s
             for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.DEEPSEEK2]
             for i in range(3) for s in (".weight", ".bias")}
    _, infos = read_gguf_header(path)
    assert {info.name for info in infos} <= known  # llama.cpp's names for the architecture
    assert ("blk.1.attn_k_b.weight" in known
            and "blk.1.attn_kv_b.weight" not in {i.name for i in infos})

    from_gguf = load_checkpoint(path, progress=False)
    from_dir = load_checkpoint(source.directory, progress=False)
    float32_eps = float(torch.tensor(from_dir.config.rms_norm_eps, dtype=torch.float32))
    assert dataclasses.replace(from_gguf.config, model_id="", rms_norm_eps=float32_eps) == \
        dataclasses.replace(from_dir.config, model_id="", rms_norm_eps=float32_eps)
    fused = {n for n in from_gguf.weights if ".mlp.experts." in n}
    assert fused == {f"model.layers.{i}.mlp.experts.{p}" for i in (1, 2)
                     for p in ("gate_up_proj", "down_proj")}
    for name, tensor in from_gguf.weights.items():
        if name not in fused:
            assert torch.equal(tensor, from_dir.weights[name]), name
    experts = [from_dir.weights[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"]
               for e in range(8)]
    assert torch.equal(from_gguf.weights["model.layers.1.mlp.experts.gate_up_proj"][:, :32],
                       torch.stack(experts))
    dense = {n for n in from_dir.weights if ".mlp.experts." not in n and ".layers.3." not in n}
    assert dense == from_gguf.weights.keys() - fused  # every tensor but the MTP layer's

    engine = LLMEngine.from_config(EngineConfig(
        model_path=str(path), num_threads=1, dtype="float32",
        cache=CacheConfig(kv_cache_memory_bytes=4 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)), progress=False)
    result = generate(engine, {"p": PROMPT}, SamplingParams(temperature=0.0, max_tokens=6,
                                                            ignore_eos=True, logprobs=True))["p"]
    tokens, logprobs = hf_greedy(source.model, PROMPT, 6)
    assert result.token_ids == tokens
    assert max(abs(a.logprob - b) for a, b in zip(result.logprobs, logprobs, strict=True)) < 2e-3
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("missing", ["deepseek2.attention.kv_lora_rank",
                                     "deepseek2.expert_feed_forward_length"])
def test_a_deepseek2_gguf_without_its_mla_or_expert_metadata_is_refused_by_name(
        missing: str, deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint],
        tmp_path: Path) -> None:
    from engine.loader.checkpoint import UnsupportedCheckpointError
    from engine.loader.gguf_deepseek2 import hf_config

    path = tmp_path / "tiny.gguf"
    write_deepseek2_gguf(deepseek_v3_checkpoints["lora"].directory, path)
    metadata, _ = read_gguf_header(path)
    assert hf_config(metadata)["kv_lora_rank"] == 32
    with pytest.raises(UnsupportedCheckpointError, match=missing.replace(".", r"\.")):
        hf_config({k: v for k, v in metadata.items() if k != missing})
