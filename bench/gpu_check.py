"""One-shot GPU check of engine/kernels (sized for an H200, under 8 minutes).

For every kernel: fresh random bf16 inputs at realistic sizes, a correctness check against the torch
reference, then the median of many CUDA-event-timed runs (after warmup, L2 flushed before each run),
reported as achieved GB/s and TFLOP/s from counted bytes and FLOPs, against the H200 roofline. FP8
GEMM is compared with a bf16 torch.matmul of the same shape. The table is printed last.

    python bench/gpu_check.py                         # exits 0 with a message when there is no GPU
    AIGW_GPU_CHECK_SMOKE=1 python bench/gpu_check.py  # tiny sizes on CPU (Triton interpreter):
                                                      # exercises this script's own code paths
Exit status: 0 when every check passed (or no GPU), 1 when a check failed or a case raised.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SMOKE = os.environ.get("AIGW_GPU_CHECK_SMOKE") == "1"
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

HBM_GBPS = 4800.0  # H200 HBM3e
PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # dense tensor-core peaks
# stop starting new cases after this
BUDGET_S = float(os.environ.get("AIGW_GPU_CHECK_BUDGET_S", "420"))
START = time.monotonic()
DEV = "cuda" if torch.cuda.is_available() and not SMOKE else "cpu"
DT = torch.float32 if SMOKE else torch.bfloat16


@dataclass
class Row:
    kernel: str
    case: str
    check: str  # "ok", "FAIL: ...", or "-" (not checked)
    ms: float | None = None
    gbytes: float = 0.0  # bytes moved, GB
    tflop: float = 0.0  # work, TFLOP
    peak: str = "bf16"
    baseline: str = ""  # e.g. "torch.matmul bf16 0.123 ms"

    def cells(self) -> list[str]:
        if self.ms is None:
            return [self.kernel, self.case, self.check, "-", "-", "-", "-", self.baseline]
        gbps = self.gbytes / (self.ms / 1e3)
        tflops = self.tflop / (self.ms / 1e3)
        roof = max(gbps / HBM_GBPS, tflops / PEAK_TFLOPS[self.peak]) * 100
        return [self.kernel, self.case, self.check, f"{self.ms:.4f}", f"{gbps:.0f}",
                f"{tflops:.1f}", f"{roof:.0f}%", self.baseline]


ROWS: list[Row] = []
_FLUSH = torch.empty(256 * 2**20 if DEV == "cuda" else 0, dtype=torch.int8, device=DEV)  # > L2


def time_left() -> float:
    return BUDGET_S - (time.monotonic() - START)


def median_ms(fn: Callable[[], object], target_s: float = 0.25) -> float:
    """Median wall time of fn (CUDA events; L2 flushed before each run)."""
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = int(min(100, max(5, target_s / max(time.perf_counter() - t, 1e-6))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        _FLUSH.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def check(got: torch.Tensor, ref: torch.Tensor, tol: float = 3e-2, *,
          norm_tol: float | None = None) -> str:
    """Elementwise (|got - ref| <= tol + tol |ref| everywhere) or, with `norm_tol`, the relative
    Frobenius error ||got - ref|| / ||ref|| (METHOD: bf16 operands land between 1e-3 and 1e-2)."""
    if not torch.isfinite(got.float()).all():
        return "FAIL: non-finite output"
    diff = (got.float() - ref.float()).abs()
    if norm_tol is not None:
        rel = (diff.norm() / ref.float().norm().clamp(min=1e-30)).item()
        return f"{'ok' if rel <= norm_tol else 'FAIL:'} rel {rel:.1e}, max {diff.max().item():.2g}"
    bound = tol + tol * ref.float().abs()
    bad = (diff > bound).float().mean().item()
    return "ok" if bad == 0 else f"FAIL: {bad:.2%} off, max err {diff.max().item():.3g}"


def case(kernel: str, name: str, body: Callable[[], Row]) -> None:
    """Run one case; record a FAIL row instead of aborting the whole check."""
    if time_left() < 0:
        ROWS.append(Row(kernel, name, "-", baseline="skipped: time budget spent"))
        return
    try:
        ROWS.append(body())
    except Exception as exc:  # report and carry on: one broken case must not hide the rest
        ROWS.append(Row(kernel, name, f"FAIL: {type(exc).__name__}: {str(exc)[:80]}"))
    finally:
        if DEV == "cuda":
            torch.cuda.empty_cache()


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV, dtype=torch.float32) * scale).to(DT)


ES = torch.tensor([], dtype=DT).element_size()


def elementwise_cases() -> None:
    import engine.kernels.activation as activation
    import engine.kernels.rmsnorm as rmsnorm
    import engine.kernels.rotary as rotary
    from engine.kernels.store_kv import store_kv_reference, store_kv_triton

    tokens = [4, 16] if SMOKE else [1, 4096, 16384]
    hidden, inter = (72, 40) if SMOKE else (4096, 14336)
    heads, kv_heads, head_dim = (6, 2, 64) if SMOKE else (32, 8, 128)
    for t in tokens:
        def norm(t=t) -> Row:
            x, res, w = randn(t, hidden), randn(t, hidden), randn(hidden)
            got = rmsnorm.rms_norm_triton(x, w, 1e-5, res)
            ref = rmsnorm.rms_norm_reference(x, w, 1e-5, res)
            ok = check(got[0], ref[0])
            ok = ok if ok != "ok" else check(got[1], ref[1])
            ms = median_ms(lambda: rmsnorm.rms_norm_triton(x, w, 1e-5, res))
            return Row("rms_norm+residual", f"T={t} H={hidden}", ok, ms, 4 * t * hidden * ES / 1e9)
        case("rms_norm+residual", f"T={t}", norm)

        def silu(t=t) -> Row:
            x = randn(t, 2 * inter)
            ok = check(activation.silu_and_mul_triton(x), activation.silu_and_mul_reference(x))
            ms = median_ms(lambda: activation.silu_and_mul_triton(x))
            return Row("silu_and_mul", f"T={t} I={inter}", ok, ms, 3 * t * inter * ES / 1e9)
        case("silu_and_mul", f"T={t}", silu)

        def rope(t=t) -> Row:
            q, k = randn(t, heads, head_dim), randn(t, kv_heads, head_dim)
            freqs = torch.outer(torch.arange(32768.0, device=DEV),
                                torch.rand(head_dim // 2, device=DEV))
            cos, sin = freqs.cos(), freqs.sin()
            pos = torch.randint(0, 32768, (t,), device=DEV)
            q2, k2 = q.clone(), k.clone()
            rotary.apply_rotary_triton(q, k, pos, cos, sin)
            rotary.apply_rotary_reference(q2, k2, pos, cos, sin)
            ok = check(q, q2) if check(k, k2) == "ok" else check(k, k2)
            ms = median_ms(lambda: rotary.apply_rotary_triton(q, k, pos, cos, sin))
            nbytes = 2 * t * (heads + kv_heads) * head_dim * ES + 2 * t * head_dim * 2
            return Row("rotary (in place)", f"T={t} {heads}/{kv_heads}x{head_dim}", ok, ms,
                       nbytes / 1e9)
        case("rotary (in place)", f"T={t}", rope)

        def store(t=t) -> Row:
            num_blocks = t // 16 + 8
            kc = torch.zeros(num_blocks, 16, kv_heads, head_dim, device=DEV, dtype=DT)
            vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
            k, v = randn(t, kv_heads, head_dim), randn(t, kv_heads, head_dim)
            slots = torch.randperm(num_blocks * 16, device=DEV)[:t]
            store_kv_triton(k, v, kc, vc, slots)
            store_kv_reference(k, v, kc2, vc2, slots)
            ok = "ok" if torch.equal(kc, kc2) and torch.equal(vc, vc2) else "FAIL: cache differs"
            ms = median_ms(lambda: store_kv_triton(k, v, kc, vc, slots))
            return Row("store_kv", f"T={t} {kv_heads}x{head_dim}", ok, ms,
                       4 * t * kv_heads * head_dim * ES / 1e9)
        case("store_kv", f"T={t}", store)


def paged_batch(ctx_lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                block_size: int = 16) -> list[torch.Tensor]:
    """Random paged cache with shuffled block ids -> [q, k_cache, v_cache, cu, seq_lens, tables]."""
    blocks_per = [-(-c // block_size) for c in ctx_lens]
    perm = torch.randperm(sum(blocks_per), device=DEV).to(torch.int32)
    tables = torch.zeros(len(ctx_lens), max(blocks_per), dtype=torch.int32, device=DEV)
    start = 0
    for i, nb in enumerate(blocks_per):
        tables[i, :nb] = perm[start : start + nb]
        start += nb
    k_cache = randn(sum(blocks_per), block_size, kv_heads, head_dim)
    v_cache = randn(sum(blocks_per), block_size, kv_heads, head_dim)
    q = randn(sum(q_lens), heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    return [q, k_cache, v_cache, cu, seq_lens, tables]


def attention_cases() -> None:
    from engine.kernels.paged_attention import paged_attention_reference, paged_attention_triton

    heads, kv_heads, head_dim = (6, 2, 64) if SMOKE else (32, 8, 128)
    scale = head_dim**-0.5
    decode = [(2, 40)] if SMOKE else [(1, 1024), (1, 32768), (16, 8192), (64, 4096), (256, 1024),
                                      (256, 4096)]
    prefill = ([("prefill 33", [33], [33]), ("decode+prefix mixed", [20, 9, 40], [1, 1, 3])]
               if SMOKE else [
        ("prefill 1x4096", [4096], [4096]),
        ("cached prefix 4x(8192+1024)", [9216] * 4, [1024] * 4),
        ("mixed 128 decode + 4x512 prefill @2048", [2048] * 132, [1] * 128 + [512] * 4),
    ])
    cases = [(f"decode B={b} ctx={c}", [c] * b, [1] * b) for b, c in decode] + prefill
    for name, ctx_lens, q_lens in cases:
        def body(name=name, ctx_lens=ctx_lens, q_lens=q_lens) -> Row:
            args = paged_batch(ctx_lens, q_lens, heads, kv_heads, head_dim)
            num_decode = next((i for i, n in enumerate(q_lens) if n > 1), len(q_lens))
            hints = {"max_query_len": max(q_lens), "max_seq_len": max(ctx_lens),
                     "num_decode_seqs": num_decode}
            got = paged_attention_triton(*args, scale, **hints)
            ok = check(got, paged_attention_reference(*args, scale))
            ms = median_ms(lambda: paged_attention_triton(*args, scale, **hints))
            visible = sum(n * (c - n) + n * (n + 1) // 2
                          for c, n in zip(ctx_lens, q_lens, strict=True))
            kv_bytes = 2 * sum(ctx_lens) * kv_heads * head_dim * ES
            qo_bytes = 2 * sum(q_lens) * heads * head_dim * ES
            row = Row("paged_attention", name, ok, ms, (kv_bytes + qo_bytes) / 1e9,
                      4 * visible * heads * head_dim / 1e12)
            if 0 < num_decode < len(q_lens):
                hints["num_decode_seqs"] = 0
                plain = median_ms(lambda: paged_attention_triton(*args, scale, **hints))
                row.baseline = f"all rows in the prefill kernel {plain:.4f} ms"
            if len(ctx_lens) == 1 and ctx_lens == q_lens and DEV == "cuda":
                row.baseline = ("torch sdpa causal dense "
                                f"{dense_sdpa_ms(args, heads, kv_heads):.4f} ms")
            return row
        case("paged_attention", name, body)


def dense_sdpa_ms(args: list[torch.Tensor], heads: int, kv_heads: int) -> float:
    """Baseline: torch's flash SDPA on the same single sequence, K/V dense and head-expanded."""
    q = args[0].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    n = q.shape[2]
    k = torch.randn(1, heads, n, q.shape[3], device=DEV, dtype=DT)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return median_ms(lambda: sdpa(q, k, v, is_causal=True))


def moe_cases() -> None:
    from engine.kernels.fused_moe import fused_moe_reference, fused_moe_triton, select_experts

    experts, hidden, inter, top_k = (4, 72, 40, 2) if SMOKE else (8, 4096, 14336, 2)  # Mixtral-8x7B
    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    for t in [1, 9] if SMOKE else [1, 16, 128, 512, 2048, 4096]:
        def body(t=t) -> Row:
            x = randn(t, hidden)
            weights, ids = select_experts(torch.randn(t, experts, device=DEV), top_k,
                                          renormalize=True)
            got = fused_moe_triton(x, w13, w2, weights, ids)
            ok = check(got, fused_moe_reference(x, w13, w2, weights, ids))
            ms = median_ms(lambda: fused_moe_triton(x, w13, w2, weights, ids))
            ref_ms = median_ms(lambda: fused_moe_reference(x, w13, w2, weights, ids))
            used = torch.unique(ids).numel()
            nbytes = (used * 3 * hidden * inter * ES + 2 * t * hidden * ES
                      + 2 * t * top_k * (inter + hidden) * ES)
            return Row("fused_moe", f"T={t} E={experts} K={top_k} H={hidden} I={inter}", ok, ms,
                       nbytes / 1e9, 6 * t * top_k * hidden * inter / 1e12,
                       baseline=f"torch per-expert loop {ref_ms:.4f} ms")
        case("fused_moe", f"T={t}", body)


def gpt_oss_moe_cases() -> None:
    """gpt-oss-20b's experts (E 32, top-4, H = I = 2880): biases and the clamped SwiGLU, bf16
    weights (fused_moe.py) and MXFP4 weights dequantized in the kernel (fused_moe_mxfp4.py)."""
    from engine.kernels.activation import ClampedSwiGLU
    from engine.kernels.fused_moe import fused_moe_reference, fused_moe_triton
    from engine.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_triton
    from engine.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    experts, hidden, inter, top_k = (4, 64, 32, 2) if SMOKE else (32, 2880, 2880, 4)
    w13_q = quantize_mxfp4(randn(experts, 2 * inter, hidden, scale=hidden**-0.5))
    w2_q = quantize_mxfp4(randn(experts, hidden, inter, scale=inter**-0.5))
    w13, w2 = dequantize_mxfp4(*w13_q, DT), dequantize_mxfp4(*w2_q, DT)
    extra = {"w13_bias": randn(experts, 2 * inter, scale=0.1),
             "w2_bias": randn(experts, hidden, scale=0.1), "activation": ClampedSwiGLU()}
    for t in [1, 9] if SMOKE else [1, 16, 128, 512, 2048]:
        def body(t=t, mxfp4=False) -> Row:
            x = randn(t, hidden)
            top, ids = torch.topk(torch.randn(t, experts, device=DEV), top_k, dim=-1)
            weights, ids = torch.softmax(top, dim=-1), ids.to(torch.int32)
            if mxfp4:
                def run() -> torch.Tensor:
                    return fused_moe_mxfp4_triton(x, *w13_q, *w2_q, weights, ids, **extra)
            else:
                def run() -> torch.Tensor:
                    return fused_moe_triton(x, w13, w2, weights, ids, **extra)
            ok = check(run(), fused_moe_reference(x, w13, w2, weights, ids, **extra))
            ms = median_ms(run)
            used = torch.unique(ids).numel()
            weight_bytes = used * 3 * hidden * inter * (17 / 32 if mxfp4 else ES)
            nbytes = weight_bytes + 2 * t * hidden * ES + 2 * t * top_k * (inter + hidden) * ES
            return Row("fused_moe gpt-oss " + ("mxfp4" if mxfp4 else "bf16"),
                       f"T={t} E={experts} K={top_k} H={hidden} I={inter}", ok, ms, nbytes / 1e9,
                       6 * t * top_k * hidden * inter / 1e12)
        case("fused_moe gpt-oss bf16", f"T={t}", body)
        case("fused_moe gpt-oss mxfp4", f"T={t}", lambda t=t: body(t, mxfp4=True))


def fp8_cases() -> None:
    import engine.kernels.fp8 as fp8

    shapes = [(72, 96)] if SMOKE else [(4096, 4096), (28672, 4096), (4096, 14336)]
    # e.g. "32,128": sweep the promotion interval
    promote = os.environ.get("AIGW_GPU_CHECK_FP8_PROMOTE_K")
    if promote:
        default = fp8._PROMOTE_K
        for value in promote.split(","):
            fp8._PROMOTE_K = int(value)
            for m in [1, 17] if SMOKE else [1, 128, 4096]:
                def sweep(m=m, value=value) -> Row:
                    n, k = (72, 96) if SMOKE else (4096, 14336)
                    xq, xs = fp8.quantize_activation_per_token(torch.randn(m, k, device=DEV))
                    wq, ws = fp8.quantize_weight_per_channel(torch.randn(n, k, device=DEV))
                    got = fp8.fp8_gemm_triton(xq, wq, xs, ws, DT)
                    ok = check(got, fp8.fp8_gemm_reference(xq, wq, xs, ws, torch.float32),
                               norm_tol=1e-2)
                    ms = median_ms(lambda: fp8.fp8_gemm_triton(xq, wq, xs, ws, DT))
                    return Row("fp8_gemm promote", f"every {value} M={m} N={n} K={k}", ok, ms,
                               (m * k + n * k + m * n * ES) / 1e9, 2 * m * n * k / 1e12, peak="fp8")
                case("fp8_gemm promote", f"{value} M={m}", sweep)
        fp8._PROMOTE_K = default
    for n, k in shapes:
        wq, ws = fp8.quantize_weight_per_channel(torch.randn(n, k, device=DEV))
        w_bf16 = randn(n, k, scale=0.02)
        for m in [1, 17] if SMOKE else [1, 16, 128, 1024, 4096]:
            def body(m=m, n=n, k=k, wq=wq, ws=ws) -> Row:
                xq, xs = fp8.quantize_activation_per_token(torch.randn(m, k, device=DEV))
                got = fp8.fp8_gemm_triton(xq, wq, xs, ws, DT)
                ok = check(got, fp8.fp8_gemm_reference(xq, wq, xs, ws, torch.float32),
                           norm_tol=1e-2)
                ms = median_ms(lambda: fp8.fp8_gemm_triton(xq, wq, xs, ws, DT))
                nbytes = m * k + n * k + m * n * ES + 4 * (m + n)
                row = Row("fp8_gemm w8a8", f"M={m} N={n} K={k}", ok, ms, nbytes / 1e9,
                          2 * m * n * k / 1e12, peak="fp8")
                if DEV == "cuda":
                    try:
                        sm = median_ms(lambda: torch._scaled_mm(
                            xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=DT))
                        row.baseline = f"torch._scaled_mm rowwise {sm:.4f} ms"
                    except Exception as exc:
                        row.baseline = f"_scaled_mm n/a ({type(exc).__name__})"
                return row
            case("fp8_gemm w8a8", f"M={m} N={n} K={k}", body)

            def bf16(m=m, n=n, k=k, w=w_bf16) -> Row:
                x = randn(m, k)
                ms = median_ms(lambda: torch.matmul(x, w.t()))
                return Row("torch.matmul bf16", f"M={m} N={n} K={k}", "-", ms,
                           (m * k + n * k + m * n) * ES / 1e9, 2 * m * n * k / 1e12)
            case("torch.matmul bf16", f"M={m} N={n} K={k}", bf16)


def fp8_block_cases() -> None:
    """The block-scaled FP8 GEMM (DeepSeek-V3 / Qwen3-FP8 checkpoints' 128 x 128 weight blocks,
    activations per token and K block) beside the per-row FP8 GEMM of the same shape."""
    import engine.kernels.fp8 as fp8
    import engine.kernels.fp8_block as fp8_block

    block = (16, 16) if SMOKE else (128, 128)
    shapes = [(72, 96)] if SMOKE else [(4096, 4096), (7168, 2048), (4096, 14336)]
    for n, k in shapes:
        w = torch.randn(n, k, device=DEV)
        wq, w_scale = fp8_block.quantize_weight_blocks(w, block)
        wq_row, ws_row = fp8.quantize_weight_per_channel(w)
        for m in [1, 17] if SMOKE else [1, 16, 128, 1024, 4096]:
            def body(m=m, n=n, k=k, wq=wq, w_scale=w_scale, wq_row=wq_row, ws_row=ws_row) -> Row:
                x = torch.randn(m, k, device=DEV)
                xq, xs = fp8_block.quantize_activation_per_group(x, block[1])
                got = fp8_block.fp8_block_gemm_triton(xq, wq, xs, w_scale, block, DT)
                ref = fp8_block.fp8_block_gemm_reference(xq, wq, xs, w_scale, block, torch.float32)
                ok = check(got, ref, norm_tol=1e-2)
                ms = median_ms(lambda: fp8_block.fp8_block_gemm_triton(xq, wq, xs, w_scale, block,
                                                                       DT))
                nbytes = m * k + n * k + m * n * ES + 4 * (xs.numel() + w_scale.numel())
                row = Row("fp8_block_gemm w8a8", f"M={m} N={n} K={k} B={block[0]}", ok, ms,
                          nbytes / 1e9, 2 * m * n * k / 1e12, peak="fp8")
                xq_row, xs_row = fp8.quantize_activation_per_token(x)
                row_ms = median_ms(lambda: fp8.fp8_gemm_triton(xq_row, wq_row, xs_row, ws_row, DT))
                row.baseline = f"per-row fp8_gemm {row_ms:.4f} ms"
                return row
            case("fp8_block_gemm w8a8", f"M={m} N={n} K={k}", body)


def end_to_end() -> None:
    """Tokens/s of a random-weight Mixtral-shaped model through the engine, bf16 and FP8.

    Needs an engine hook `engine.testing.build_random_engine(arch, dtype, quantization, num_layers)`
    returning an object with `generate(prompt_token_ids, max_tokens) -> list of outputs carrying
    token_ids` (to be wired by the engine's owners); skipped with the reason printed until then.
    """
    try:
        from engine.testing import build_random_engine  # type: ignore[import-not-found]
    except Exception as exc:
        print(f"[e2e] skipped: engine hook not importable ({type(exc).__name__}: {exc})")
        return
    from engine.testing import mixtral_config

    # Smoke mode (CPU): a tiny Mixtral-shaped config, so the path is exercised without 10 GB of
    # weights.
    tiny = None
    if SMOKE:
        tiny = dataclasses.replace(mixtral_config(2), hidden_size=64, intermediate_size=96,
                                   moe_intermediate_size=96, num_heads=4, num_kv_heads=2,
                                   head_dim=16, vocab_size=1024)
    num_prompts, prompt_len, new_tokens = (4, 32, 8) if SMOKE else (64, 512, 128)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for quant in (None, "fp8"):
        def body(quant=quant) -> Row:
            eng = build_random_engine("mixtral", dtype="float32" if SMOKE else "bfloat16",
                                      quantization=quant, num_layers=2 if SMOKE else 8,
                                      model_config=tiny)
            prompts = [[int(i) % 1000 + 1 for i in range(prompt_len)] for _ in range(num_prompts)]
            eng.generate(prompts[:2], max_tokens=4)  # warmup / compile
            sync()
            t = time.perf_counter()
            outs = eng.generate(prompts, max_tokens=new_tokens)
            sync()
            dt = time.perf_counter() - t
            generated = sum(len(o.token_ids) for o in outs)
            return Row("e2e mixtral",
                       f"{quant or 'bf16'} {num_prompts}x({prompt_len}+{new_tokens})", "-",
                       baseline=f"{generated / dt:.0f} generated tok/s, {dt:.1f} s")
        case("e2e", quant or "bf16", body)


def tensor_parallel_cases() -> None:
    """TP=N (every GPU, at most 4) against TP=1 on the default model in bf16: 32 prompts of 256
    tokens, 64 new tokens each. Rows: generated tok/s of both, the share of sequences with the same
    greedy tokens (bf16 sums in another order can flip a near-tie), and rank 0's time in
    collectives per step (NCCL launches are asynchronous: a lower bound). Needs >= 2 GPUs."""
    num_ranks = min(torch.cuda.device_count(), 4) if DEV == "cuda" else 0
    if num_ranks < 2:
        print("[tp] skipped: tensor parallelism needs 2 or more CUDA devices")
        return
    from contracts.sampling_params import SamplingParams
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import LLMEngine
    from engine.loader import default_model_path

    prompts = [[(i * 7 + j) % 1000 + 1 for j in range(256)] for i in range(32)]
    outputs: dict[int, dict[str, list[int]]] = {}

    def run(tp: int) -> Row:
        config = EngineConfig(model_path=str(default_model_path()), device="cuda",
                              tensor_parallel_size=tp,
                              cache=CacheConfig(kv_cache_memory_bytes=1 << 30))
        engine = LLMEngine.from_config(config, progress=False)
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                                                   ignore_eos=True))
            tokens: dict[str, list[int]] = {}
            torch.cuda.synchronize()
            start = time.perf_counter()
            while engine.has_unfinished_requests:
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            elapsed = time.perf_counter() - start
            outputs[tp] = tokens
            note = f"{sum(map(len, tokens.values())) / elapsed:.0f} generated tok/s"
            if tp > 1:
                runner = engine.runner
                steps = max(runner.num_steps, 1)  # type: ignore[attr-defined]
                note += (f", {runner.group.comm_s / steps * 1e3:.2f} ms "  # type: ignore[attr-defined]
                         f"of {elapsed / steps * 1e3:.2f} ms "
                         "per step in collectives (rank 0)")
            check_text = "-"
            if tp > 1 and 1 in outputs:
                same = sum(outputs[1][k] == v for k, v in tokens.items()) / len(tokens)
                check_text = (f"{'ok' if same >= 0.5 else 'FAIL:'} {same:.0%} sequences equal to "
                              "TP=1")
            return Row("tensor parallel", f"TP={tp} 32x(256+64) bf16", check_text, baseline=note)
        finally:
            close = getattr(engine.runner, "close", None)
            if close is not None:
                close()

    for tp in (1, num_ranks):
        case("tensor parallel", f"TP={tp}", lambda tp=tp: run(tp))


def print_table() -> None:
    head = ["kernel", "case", "check", "ms", "GB/s", "TFLOP/s", "%roof", "baseline"]
    rows = [head] + [r.cells() for r in ROWS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print(f"\nH200 roofline: {HBM_GBPS:.0f} GB/s HBM, {PEAK_TFLOPS['bf16']:.0f} bf16 / "
          f"{PEAK_TFLOPS['fp8']:.0f} fp8 dense TFLOP/s; %roof = max(GB/s, TFLOP/s share)")
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main() -> int:
    if not torch.cuda.is_available() and not SMOKE:
        print("gpu_check: no CUDA device present; nothing to check (exit 0).")
        return 0
    import triton

    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke, Triton interpreter)"
    print(f"gpu_check on {name}: torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    torch.manual_seed(0)
    sections = (elementwise_cases, attention_cases, end_to_end, moe_cases, gpt_oss_moe_cases,
                fp8_cases, fp8_block_cases, tensor_parallel_cases)
    chosen = os.environ.get("AIGW_GPU_CHECK_SECTIONS")  # e.g. "fp8_cases,end_to_end"
    if chosen:
        sections = tuple(s for s in sections if s.__name__ in chosen.split(","))
    for section in sections:
        print(f"== {section.__name__} at {time.monotonic() - START:.0f} s", flush=True)
        try:
            section()
        except Exception as exc:
            ROWS.append(Row(section.__name__, "-", f"FAIL: {type(exc).__name__}: {str(exc)[:80]}"))
    print_table()
    failed = [r for r in ROWS if r.check.startswith("FAIL")]
    print(f"\n{len(ROWS)} rows, {len(failed)} failed, {time.monotonic() - START:.0f} s total")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
