"""Qwen3 / Qwen3-MoE config.json mapping, their sliding-window layers against transformers, and the
one-line errors a checkpoint that does not fit its config gets before serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.loader import load_checkpoint
from engine.loader.checkpoint import UnsupportedCheckpointError
from engine.loader.hf_checkpoint import model_config_from_hf
from engine.models.weights import CheckpointMismatchError
from tests.engine.fakes import assert_idle_and_clean, generate
from tests.engine.models._greedy import hf_greedy, make_runner
from tests.engine.models._qwen3 import TinyCheckpoint, make_config


def test_qwen3_config_maps_head_dim_per_head_qk_norm_and_tied_embeddings(
        qwen3_checkpoints: dict[str, TinyCheckpoint]) -> None:
    config = model_config_from_hf(qwen3_checkpoints["qwen3"].directory)
    assert ((config.architecture, config.head_dim, config.hidden_size // config.num_heads)
            == ("qwen3", 32, 16))
    assert config.qk_norm == "per_head" and config.tie_word_embeddings and not config.attention_bias
    assert not config.is_moe and config.layer_types is None and config.sliding_window is None


def test_qwen3_moe_config_maps_experts_and_which_layers_are_sparse(
        qwen3_checkpoints: dict[str, TinyCheckpoint]) -> None:
    config = model_config_from_hf(qwen3_checkpoints["qwen3_moe"].directory)
    assert ((config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size)
            == (8, 2, 32))
    assert config.norm_topk_prob and config.mlp_only_layers == (1,) and config.qk_norm == "per_head"
    assert [config.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    step2 = model_config_from_hf(qwen3_checkpoints["qwen3_moe-step2"].directory)
    assert not step2.norm_topk_prob and step2.decoder_sparse_step == 2
    assert [step2.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]
    assert step2.shared_expert_intermediate_size == 0


def _windowed(name: str, directory: Path) -> torch.nn.Module:
    """`name` with an 8-token window: qwen3 on layer 1 only (max_window_layers 1), qwen3_moe on
    all."""
    import transformers

    config = make_config(name)
    config.use_sliding_window, config.sliding_window = True, 8
    if name == "qwen3":
        config.max_window_layers, config.layer_types = 1, ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("name,layer_types", [
    ("qwen3", ("full_attention", "sliding_attention")), ("qwen3_moe", ("sliding_attention",) * 3)])
def test_sliding_window_layers_generate_what_transformers_does(
        name: str, layer_types: tuple[str, ...], qwen3_checkpoints: dict[str, TinyCheckpoint],
        tmp_path: Path) -> None:
    model = _windowed(name, tmp_path)
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_checkpoints[name].directory / tokenizer_file, tmp_path)
    engine = LLMEngine.from_config(EngineConfig(
        model_path=str(tmp_path), num_threads=1, dtype="float32",
        cache=CacheConfig(kv_cache_memory_bytes=4 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)), progress=False)
    assert (engine.model_config.layer_types, engine.model_config.sliding_window) == (layer_types, 8)
    prompt = list(range(3, 43))  # 40 tokens: 5 windows, prefilled in 3 chunks
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = generate(engine, {"p": prompt}, params)["p"].token_ids
    assert ours == hf_greedy(model, prompt, 8)[0]
    assert_idle_and_clean(engine)


def test_a_config_with_the_window_off_has_no_sliding_layers(tmp_path: Path) -> None:
    """As the released Qwen3 configs: use_sliding_window false, whatever sliding_window says."""
    config = make_config("qwen3").to_dict() | {"use_sliding_window": False, "sliding_window": 32768,
                                                "max_window_layers": 0, "layer_types": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mapped = model_config_from_hf(tmp_path)
    assert mapped.layer_types is None and mapped.sliding_window is None


# ---- misfits: one line naming the tensor or the setting, before serving ------------------------
def _copy_with(source: Path, tmp_path: Path, edit_tensors=None, edit_config=None) -> Path:  # type: ignore[no-untyped-def]
    directory = tmp_path / source.name
    shutil.copytree(source, directory)
    if edit_tensors is not None:
        (file,) = directory.glob("*.safetensors")
        tensors = load_file(file)
        edit_tensors(tensors)
        save_file(tensors, file)
    if edit_config is not None:
        config = json.loads((directory / "config.json").read_text())
        edit_config(config)
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def _build(directory: Path) -> None:
    checkpoint = load_checkpoint(directory, progress=False)
    make_runner(checkpoint.config, checkpoint.weights)


def test_a_missing_tensor_is_named(qwen3_checkpoints: dict[str, TinyCheckpoint],
                                   tmp_path: Path) -> None:
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    directory = _copy_with(qwen3_checkpoints["qwen3_moe"].directory, tmp_path,
                           edit_tensors=lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointMismatchError, match=rf"^checkpoint has no tensor '{name}' "
                                                      r"\(qwen3_moe layer 2\)$"):
        _build(directory)


def test_a_tensor_left_unused_is_named(qwen3_checkpoints: dict[str, TinyCheckpoint],
                                       tmp_path: Path) -> None:
    def add_bias(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128)

    directory = _copy_with(qwen3_checkpoints["qwen3"].directory, tmp_path, edit_tensors=add_bias)
    with pytest.raises(CheckpointMismatchError, match=r"no qwen3 layer uses: "
                                                      r"'model\.layers\.0\.self_attn\.q_proj\.bias'$"):
        _build(directory)


def test_an_unsupported_architecture_or_setting_is_one_value_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    with pytest.raises(UnsupportedCheckpointError,
                       match="model_type 'qwen3_next' is not supported"):
        model_config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 8}))
    with pytest.raises(ValueError,
                       match=r"config\.json: no 'num_attention_heads' \(model_type 'qwen3' needs "
                             r"it\)"):
        model_config_from_hf(tmp_path)


def test_replica_refuses_a_shape_mismatch_in_one_line_before_serving(
        qwen3_checkpoints: dict[str, TinyCheckpoint], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """config.json says head_dim 16, the file's q_norm weights are 32 wide: `aigw replica` says
    which tensor and both shapes, and exits 1 without a traceback (and never listens)."""
    from cli.main import main

    directory = _copy_with(qwen3_checkpoints["qwen3"].directory, tmp_path,
                           edit_config=lambda config: config.update(head_dim=16,
                                                                    num_attention_heads=8,
                                                                    num_key_value_heads=4))
    monkeypatch.setenv("AIGW_REPLICA_SECRET", "test-secret")
    status = main(["replica", "--model", str(directory), "--port", "0", "--threads", "1"])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "aigw: CheckpointMismatchError: checkpoint tensor 'model.layers.0.self_attn.q_norm.weight' "
        "has shape (32,), expected (16,)")
