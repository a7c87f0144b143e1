"""Compile every Triton kernel ahead of time for Hopper (sm_90) on a machine without a GPU.

Triton ships ptxas, so source -> TTIR -> TTGIR -> PTX -> cubin runs on CPU; this catches what the
interpreter cannot (lowering errors, layouts, shared-memory overflow) before a GPU is at hand.
Run as a script (outside the interpreter): `python -m tests.engine.kernels.compile_sm90 [--all]`;
without --all only the first candidate config of each tuned kernel is built. Prints one JSON
line per kernel build and exits 1 if any build failed or exceeds Hopper's shared memory.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import importlib  # noqa: E402

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402


def _module(name: str):
    # engine.kernels re-exports functions named like some modules (store_kv, fused_moe, ...),
    # so `from engine.kernels import store_kv` gives the function: import the modules by path.
    return importlib.import_module(f"engine.kernels.{name}")


activation, fp8, fused_moe = _module("activation"), _module("fp8"), _module("fused_moe")
fused_moe_mxfp4 = _module("fused_moe_mxfp4")
paged_attention, paged_decode = _module("paged_attention"), _module("paged_decode")
rmsnorm, rotary, store_kv = _module("rmsnorm"), _module("rotary"), _module("store_kv")

HOPPER = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 232448  # H100 / H200 opt-in shared memory per block
FLOAT_ARGS = {"eps", "qk_scale_log2", "swiglu_alpha", "swiglu_limit"}
# At realistic shapes the JIT specializes 16-aligned pointers and multiples of 16; mirror that.
DIVISIBLE_INTS = {"N", "K", "head_dim", "hidden", "inter", "chunk_len"}


def build(name: str, fn, ptr_types: dict[str, str], constexprs: dict, options: dict) -> dict:
    signature, attrs = {}, {}
    for i, (arg, param) in enumerate(zip(fn.arg_names, fn.params, strict=True)):
        if not param.is_constexpr and (arg.endswith("_ptr") or arg.startswith("stride")
                                       or arg in DIVISIBLE_INTS):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if param.is_constexpr:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = ptr_types.get(arg, "*bf16")
        else:
            signature[arg] = "fp32" if arg in FLOAT_ARGS else "i32"
    start = time.monotonic()
    try:
        compiled = compile(ASTSource(fn, signature, constexprs, attrs), target=HOPPER,
                           options=options)
        shared = compiled.metadata.shared
        pipelined = "async_copy" in compiled.asm["ttgir"] or "async_tma" in compiled.asm["ttgir"]
        ok = shared <= MAX_SHARED_BYTES
        error = None if ok else f"shared memory {shared} > {MAX_SHARED_BYTES}"
    except Exception as exc:  # report every failure, not only the first
        shared, pipelined, ok, error = None, False, False, f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"kernel": name, "constexprs": constexprs, "options": options, "ok": ok,
            "shared": shared, "pipelined": pipelined, "error": error,
            "seconds": round(time.monotonic() - start, 1)}


def split(cfg: dict) -> tuple[dict, dict]:
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    return meta, {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}


def jobs(all_configs: bool):
    def pick(configs):
        return list(configs) if all_configs else list(configs)[:1]

    yield ("rms_norm", rmsnorm._kernels().rms_norm, {}, {"HAS_RESIDUAL": True, "BLOCK": 4096},
           {"num_warps": 16})
    yield ("silu_and_mul", activation._kernels().silu_and_mul, {}, {"BLOCK": 1024}, {})
    yield ("rotary", rotary._kernels().rotary, {"pos_ptr": "*i64", "cos_ptr": "*fp32",
           "sin_ptr": "*fp32"}, {"HALF": 64, "BLOCK_H": 32, "BLOCK_HALF": 64}, {})
    yield ("store_kv", store_kv._kernels().store_kv, {"slot_ptr": "*i64"},
           {"BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128}, {})
    ints = {"cu_q_ptr": "*i32", "seq_lens_ptr": "*i32", "bt_ptr": "*i32"}
    for cfg in pick(paged_attention._PREFILL_CONFIGS):
        meta, opts = split(cfg)
        yield ("paged_prefill", paged_attention._kernels().prefill, ints,
               {"GROUP": 4, "BLOCK_D": 128, **meta}, opts)
    fp32_parts = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    decode = paged_decode._kernels()
    yield ("paged_decode_split", decode.split, ints | fp32_parts,
           {"GROUP": 4, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128}, {"num_warps": 4})
    yield ("paged_decode_reduce", decode.reduce, fp32_parts, {"BLOCK_P": 32, "BLOCK_D": 128}, {})
    moe_ptrs = {"weights_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
                "num_post_padded_ptr": "*i32"}
    for cfg in pick(fused_moe._CONFIGS_SMALL_T) + pick(fused_moe._CONFIGS_LARGE_T):
        meta, opts = split(cfg)
        for fuse in (True, False):
            yield ("fused_moe_gemm", fused_moe._kernels().gemm, moe_ptrs,
                   {"PAIRS_PER_A_ROW": 2 if fuse else 1, "FUSE_SILU": fuse, "MUL_WEIGHT": not fuse,
                    "CLAMPED_SWIGLU": False, "HAS_BIAS": False, **meta}, opts)
    # gpt-oss: expert biases and the clamped SwiGLU; the MXFP4 variant reads uint8 blocks + scales
    meta, opts = split(fused_moe._CONFIGS_SMALL_T[0])
    mxfp4_meta, mxfp4_opts = split(fused_moe_mxfp4._CONFIG)
    for fuse in (True, False):
        gpt_oss = {"PAIRS_PER_A_ROW": 4 if fuse else 1, "FUSE_SILU": fuse, "MUL_WEIGHT": not fuse,
                   "CLAMPED_SWIGLU": fuse, "HAS_BIAS": True}
        yield ("fused_moe_gemm_gpt_oss", fused_moe._kernels().gemm, moe_ptrs, gpt_oss | meta, opts)
        yield ("fused_moe_mxfp4_gemm", fused_moe_mxfp4._kernels().gemm,
               moe_ptrs | {"blocks_ptr": "*u8", "scales_ptr": "*u8"}, gpt_oss | mxfp4_meta,
               mxfp4_opts)
    fp8_ptrs = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32",
                "b_scale_ptr": "*fp32"}
    for cfg in pick(fp8._CONFIGS_SMALL_M) + pick(fp8._CONFIGS_LARGE_M):
        meta, opts = split(cfg)
        yield ("fp8_gemm", fp8._kernels().gemm, fp8_ptrs,
               {"PROMOTE_K": min(fp8._PROMOTE_K, meta["BLOCK_K"]), **meta}, opts)


def main() -> int:
    failed = 0
    for name, fn, ptrs, constexprs, options in jobs("--all" in sys.argv):
        result = build(name, fn, ptrs, constexprs, options)
        failed += not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
