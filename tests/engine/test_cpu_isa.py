"""The native CPU kernels' ISA variant (engine/kernels/cpu/isa.py): chosen from the CPU's flags,
forcible with AIGW_CPU_ISA, refused when the CPU lacks it; and the forced-AVX2 build gives the same
q4 tokens as this process's native one on reference prompts (on an AVX-512 / VNNI machine the two
are different builds; on an AVX2-only one the same)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.kernels import cpu as native
from engine.kernels.cpu import isa
from engine.model_runner import ModelRunner
from tests.engine.fakes import generate
from tests.engine.test_cpu_isa_variants import kernel_outputs

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
PROMPTS = ["What is the capital of France?", "Write a haiku about rain."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_the_native_kernels_load_wherever_the_cpu_can_run_them() -> None:
    """The native-kernel tests skip where `native.load()` is False. That must mean a CPU (or an OS,
    a missing C++ compiler, AIGW_NATIVE_KERNELS=0) that cannot run them, never a build of our
    source that failed: that is this test's failure, not a run of skips."""
    if os.environ.get("AIGW_NATIVE_KERNELS", "1") == "0":
        pytest.skip("AIGW_NATIVE_KERNELS=0 turns the native kernels off")
    missing = sorted(AVX2 - native._cpu_flags())
    if missing or isa.selection().variant is None:
        pytest.skip(f"this CPU cannot run the native kernels ({missing or 'no OS AVX2 state'})")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler to build the native kernels")
    assert native.load(), "the native CPU kernels did not build here (the warning logged says why)"


def test_the_best_variant_the_cpu_has_is_chosen() -> None:
    assert isa.select(AVX2, None).variant == "avx2"
    assert isa.select(AVX512, "native").variant == "avx512"
    assert isa.select(AVX512 | {"avx512_vnni"}, None).variant == "avx512_vnni"
    assert isa.select(AVX2 | {"avx_vnni"}, "").variant == "avx_vnni"
    chosen = isa.select(AVX512 | {"avx512_vnni", "avx512_bf16", "amx_bf16"}, None)
    assert not chosen.forced and {"avx512_bf16", "amx_bf16"} <= set(chosen.features)
    assert isa.select(frozenset({"sse4_2"}), None).variant is None


def test_aigw_cpu_isa_forces_a_variant_the_cpu_has_and_refuses_others() -> None:
    forced = isa.select(AVX512 | {"avx512_vnni"}, "AVX2")
    assert (forced.variant, forced.forced, forced.native) == ("avx2", True, "avx512_vnni")
    with pytest.raises(ValueError, match="lacks avx512_vnni"):
        isa.select(AVX512, "avx512_vnni")
    with pytest.raises(ValueError, match="unknown"):
        isa.select(AVX2, "sse9")


def test_a_variant_the_os_does_not_enable_is_never_chosen() -> None:
    """/proc/cpuinfo lists AVX-512 but PyTorch's cpuinfo (XCR0) finds the ZMM state off."""
    cpu = AVX512 | {"avx512_vnni"}
    assert isa.select(cpu, None, os_flags=AVX2).variant == "avx2"
    with pytest.raises(ValueError, match="lacks avx512f"):
        isa.select(cpu, "avx512_vnni", os_flags=AVX2)
    assert isa.select(cpu, None, os_flags=cpu).variant == "avx512_vnni"
    assert isa.os_enabled_flags() is None or {"avx2", "fma"} <= isa.os_enabled_flags()  # type: ignore[operator]
    if not isa.selection().forced:  # this process: the best of what the CPU and the OS both have
        usable = isa.cpu_flags() & (isa.os_enabled_flags() or isa.cpu_flags())
        assert isa.selection().variant == isa.best_variant(usable)


def test_bf16_prefill_is_the_best_the_cpu_has_and_forcible_anywhere() -> None:
    amx = AVX512 | {"avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert isa.select(amx, None).prefill == "amx_bf16"
    assert isa.select(AVX512 | {"avx512_bf16"}, None).prefill == "avx512_bf16"
    assert isa.select(AVX512 | {"avx512_vnni"}, None).prefill is None
    assert isa.select(amx, "avx512_vnni").prefill is None  # a variant name: integer prefill
    forced = isa.select(amx, "avx512_bf16")
    assert (forced.variant, forced.prefill, forced.forced, forced.prefill_emulated) == (
        "avx512_vnni", "avx512_bf16", True, False)
    emulated = isa.select(AVX2, "amx_bf16")  # PyTorch's bf16 GEMMs run on any CPU (slow there)
    assert ((emulated.variant, emulated.prefill, emulated.prefill_emulated)
            == ("avx2", "amx_bf16", True))
    assert "amx_bf16" in emulated.describe() and emulated.as_dict()["prefill_isa"] == "amx_bf16"
    with pytest.raises(ValueError, match="AVX2"):
        isa.select(frozenset({"sse4_2"}), "amx_bf16")
    assert isa.onednn_cap(forced) == "AVX512_CORE_BF16"  # else oneDNN takes AMX for bf16 anyway
    assert isa.onednn_cap(isa.select(amx, None)) is None
    assert isa.onednn_cap(isa.select(AVX512 | {"avx512_bf16"}, "avx512_bf16")) is None


def test_a_bad_aigw_cpu_isa_stops_the_replica_before_it_loads_a_model() -> None:
    env = {**os.environ,
           "AIGW_CPU_ISA": "avx512_vnni" if "avx512_vnni" not in isa.cpu_flags() else "sse9"}
    done = subprocess.run([sys.executable, "-m", "cli.main", "generate", "hi", "--max-tokens", "1"],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "AIGW_CPU_ISA" in done.stderr
    assert "Traceback" not in done.stderr


_CHILD = """
import json, sys
from engine.kernels import cpu as native
from tests.engine.test_cpu_isa import q4_tokens
from tests.engine.test_cpu_isa_variants import kernel_outputs
from engine.loader import load_checkpoint, load_tokenizer
import torch
path = sys.argv[1]
print(json.dumps({"variant": native.loaded_variant(), "outputs": kernel_outputs(),
                  "tokens": q4_tokens(path,
                                      load_checkpoint(path, dtype=torch.float32, progress=False),
                                      load_tokenizer(path))}))
"""


def q4_tokens(model_path: str, checkpoint: Any, tokenizer: Any) -> list[list[int]]:
    config = EngineConfig(model_path=model_path, num_threads=1, decode_weights="q4",
                          cache=CacheConfig(kv_cache_memory_bytes=32 << 20,
                                            enable_prefix_caching=False))
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    engine = LLMEngine(config, checkpoint.config, runner, tokenizer)
    prompts = {str(i): tokenizer.encode_chat([{"role": "user", "content": p}])
               for i, p in enumerate(PROMPTS)}
    return [c.token_ids for _, c in sorted(generate(engine, prompts, GREEDY).items())]


@pytest.mark.skipif(not native.load(), reason="native CPU kernels unavailable here")
def test_forced_avx2_kernels_give_the_native_kernels_outputs_and_tokens(
        model_path: str, checkpoint: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every op bit for bit (tests/engine/test_cpu_isa_variants.py kernel_outputs) and the greedy
    q4 tokens. Not skipped on an AVX-512 / VNNI CPU: there the native build is the best one the CPU
    and OS have (unless AIGW_CPU_ISA forces another), so two builds are compared."""
    chosen = isa.selection()  # the integer kernels alone: a bf16 prefill (AMX CPUs) is tested apart
    if not chosen.forced:
        assert native.loaded_variant() == chosen.native
    monkeypatch.setattr(isa, "selection", lambda: dataclasses.replace(chosen, prefill=None))
    ours = q4_tokens(model_path, checkpoint, tokenizer)
    env = {**os.environ, "AIGW_CPU_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", _CHILD, model_path],
                          cwd=Path(__file__).resolve().parents[2],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["variant"] == "avx2" and native.loaded_variant() == isa.selection().variant
    outputs = kernel_outputs()
    assert outputs.keys() == child["outputs"].keys()
    for name, values in outputs.items():
        assert values == child["outputs"][name], (f"{name}: {native.loaded_variant()} differs from "
                                                  "avx2")
    assert child["tokens"] == ours and all(len(t) == GREEDY.max_tokens for t in ours)
