"""Every Triton kernel lowers to a Hopper (sm_90) cubin, within shared memory, GEMMs pipelined.

Runs tests/engine/kernels/compile_sm90.py in a subprocess (outside the interpreter); needs only the
ptxas that ships with Triton, no GPU.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[3]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
def test_every_kernel_compiles_for_hopper_and_gemm_loops_are_pipelined():
    out = subprocess.run([sys.executable, "-m", "tests.engine.kernels.compile_sm90"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    failures = [r for r in results if not r["ok"]]
    assert out.returncode == 0 and not failures, (failures, out.stderr[-2000:])
    names = {r["kernel"] for r in results}
    assert names == {"rms_norm", "silu_and_mul", "rotary", "store_kv", "paged_prefill",
                     "paged_decode_split", "paged_decode_reduce", "fused_moe_gemm", "fp8_gemm",
                     "fused_moe_gemm_gpt_oss", "fused_moe_mxfp4_gemm"}
    # (the MXFP4 GEMM dequantizes its B tiles in registers; its loads are not software-pipelined
    # yet)
    for r in results:
        if r["kernel"] in ("paged_prefill", "paged_decode_split", "fused_moe_gemm", "fp8_gemm",
                           "fused_moe_gemm_gpt_oss"):
            assert r["pipelined"], r
