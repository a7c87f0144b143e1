"""bench/gpu_check.py must stay runnable: its smoke mode runs every section on CPU at tiny sizes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "gpu_check.py"


def run_script(**env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=full_env, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="smoke mode is the CPU interpreter path; on a GPU the real check runs "
                           "instead (the interpreter of Triton 3.6 fails FP8 on a CUDA machine)")
def test_smoke_mode_checks_every_kernel_and_prints_the_table_last():
    out = run_script(AIGW_GPU_CHECK_SMOKE="1", OMP_NUM_THREADS="2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for kernel in ("rms_norm+residual", "silu_and_mul", "rotary", "store_kv", "paged_attention",
                   "fused_moe", "fp8_gemm w8a8"):
        assert kernel in out.stdout
    assert "FAIL" not in out.stdout
    assert out.stdout.rstrip().splitlines()[-1].endswith("s total")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path")
def test_without_gpu_it_exits_zero_with_a_message():
    out = run_script()
    assert out.returncode == 0 and "no CUDA device" in out.stdout
