"""Why every ISA variant of the native kernels gives the same results, checked where a CPU can and
emulated where it cannot.

The variants differ only in the block dot product's integer instructions (decode_ops.cpp dp_first /
dp_next / dp_total, dot_q8x8): AVX2 sums u8 x s8 products in pairs into int16 (vpmaddubsw,
saturating), chains int16 adds (wrapping) and widens pairs to int32 (vpmaddwd with ones); VNNI
(vpdpbusd, AVX512-VNNI or AVX-VNNI) adds the four products of each 32-bit lane straight into int32,
never saturating. The two agree exactly while no int16 step saturates or wraps: Q4 codes <= 15 and
activations |q| <= 127 give 8 x 2 x 15 x 127 = 30,480 per int16 lane of a block; Q8 weights
|w| <= 128 against |q| <= 127 give 2 x 128 x 127 = 32,512 per pair (Q8 widens every vector).

Here: numpy models of both instruction sequences, run on the kernels' interleaved weight layouts,
agree with each other and with exact integer sums on random and worst-case blocks (and the AVX2
model does saturate past those bounds, so it is a model of the instruction, not of the sum); the
build this process loaded reproduces the exact sums on the worst cases; and (tests/engine/
test_cpu_isa.py, with `kernel_outputs` below) the build `AIGW_CPU_ISA=avx2` loads gives the same
bits as this process's on every op (on an AVX-512 / VNNI CPU two builds; on an AVX2-only one the
same build, and the emulation here is what checks VNNI).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels import cpu as native
from engine.layers.native_linear import interleave_q4_1, interleave_q8_0

QK = 32


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """decode_ops.cpp quantize_row in float32: per 32 values, scale = max|x| / 127,
    q = rint(x / scale) -> (q int8 [M, K], d [M, nb], d * sum(q) [M, nb])."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, QK)
    scale = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int8)
    return q.reshape(x.shape), scale, (scale * q.astype(np.int32).sum(-1)).astype(np.float32)


def _saturate16(v: np.ndarray) -> np.ndarray:
    return np.clip(v, -32768, 32767)


def _wrap16(v: np.ndarray) -> np.ndarray:
    return ((v + 32768) % 65536) - 32768


def avx2_sums(u: np.ndarray, s: np.ndarray, widen_each_vector: bool) -> np.ndarray:
    """u (unsigned codes), s (signed) [..., 32] per column block, lane order 4v + i (vector v of 8,
    byte i of the lane) -> the int32 the AVX2 sequence leaves: maddubs per vector (pairs, int16
    saturation), then madd with ones per vector (Q8) or an int16 wrapping chain over the 8 vectors
    first (Q4)."""
    p = (u.astype(np.int64).reshape(*u.shape[:-1], 8, 2, 2)
         * s.astype(np.int64).reshape(*s.shape[:-1], 8, 2, 2))
    pairs = _saturate16(p.sum(-1))  # [..., 8 vectors, 2 int16 halves of the lane]
    if widen_each_vector:
        return pairs.sum(-1).sum(-1)  # madd per vector, int32 adds
    chain = pairs[..., 0, :]
    for v in range(1, 8):
        chain = _wrap16(chain + pairs[..., v, :])
    return chain.sum(-1)  # madd with ones: the two int16 halves into int32


def vnni_sums(u: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The vpdpbusd chain: each vector's 4 u8 x s8 products of a lane added into int32."""
    p = (u.astype(np.int64).reshape(*u.shape[:-1], 8, 4)
         * s.astype(np.int64).reshape(*s.shape[:-1], 8, 4))
    acc = np.zeros(u.shape[:-1], dtype=np.int64)
    for v in range(8):
        acc = (acc + p[..., v, :].sum(-1) + 2**31) % 2**32 - 2**31  # int32 lanes, no saturation
    return acc


def exact_sums(u: np.ndarray, s: np.ndarray) -> np.ndarray:
    return (u.astype(np.int64) * s.astype(np.int64)).sum(-1)


def _q8_operands(w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dot_q8x8's operands: |w| (unsigned; -128 becomes 128) and x * sign(w)."""
    return np.abs(w.astype(np.int64)), x.astype(np.int64) * np.sign(w.astype(np.int64))


@pytest.mark.parametrize("case", ["random", "worst"])
def test_the_avx2_and_vnni_sequences_give_the_exact_integer_sums(case: str) -> None:
    rng = np.random.default_rng(0)
    shape = (64, 32)  # column blocks x 32 inputs
    if case == "random":
        codes = rng.integers(0, 16, shape)
        w8 = rng.integers(-128, 128, shape)
        x = rng.integers(-127, 128, shape)
    else:  # every product at its largest, one sign and the other
        codes = np.full(shape, 15)
        w8 = (np.where(np.arange(shape[0])[:, None] % 2 == 0, -128, 127)
              * np.ones(shape, dtype=np.int64))
        x = (np.where(np.arange(shape[0])[:, None] % 4 < 2, 127, -127)
             * np.ones(shape, dtype=np.int64))
    assert np.array_equal(avx2_sums(codes, x, widen_each_vector=False), exact_sums(codes, x))
    assert np.array_equal(vnni_sums(codes, x), exact_sums(codes, x))
    u, s = _q8_operands(w8, x)
    assert np.array_equal(avx2_sums(u, s, widen_each_vector=True), exact_sums(w8, x))
    assert np.array_equal(vnni_sums(u, s), exact_sums(w8, x))


def test_the_avx2_model_saturates_past_the_kernels_bounds() -> None:
    """Codes of 8 bits (not 4) against 127: the int16 chain overflows, so the model would catch a
    layout whose sums exceed int16; the VNNI model still gives the exact sum."""
    u, s = np.full((1, 32), 255), np.full((1, 32), 127)
    assert not np.array_equal(avx2_sums(u, s, widen_each_vector=False), exact_sums(u, s))
    assert np.array_equal(vnni_sums(u, s), exact_sums(u, s))


def _q4_1_rows(codes: np.ndarray, d: float, m: float) -> np.ndarray:
    """Q4_1 raw rows [N, nb * 20] (d f16 | m f16 | 16 bytes: input i low nibble, i + 16 high)."""
    n, k = codes.shape
    blocks = codes.reshape(n, k // QK, QK).astype(np.uint8)
    packed = blocks[..., :16] | (blocks[..., 16:] << 4)
    scales = np.broadcast_to(np.array([d, m], dtype=np.float16).view(np.uint8), (n, k // QK, 4))
    return np.concatenate([scales, packed], axis=-1).reshape(n, -1)


def _q8_0_rows(q: np.ndarray, d: float) -> np.ndarray:
    n, k = q.shape
    scales = np.broadcast_to(np.array([d], dtype=np.float16).view(np.uint8), (n, k // QK, 2))
    return np.concatenate([scales, q.reshape(n, k // QK, QK).astype(np.int8).view(np.uint8)],
                          axis=-1).reshape(n, -1)


pytestmark_kernels = pytest.mark.skipif(not native.load(),
                                        reason="native CPU kernels unavailable here")


@pytestmark_kernels
@pytest.mark.parametrize("num_rows", [1, 5])  # 5: the many-row (pre-broadcast) Q4 kernel too
def test_the_loaded_kernels_reach_the_exact_sums_on_worst_case_blocks(num_rows: int) -> None:
    n, k = 16, 128
    x = (np.where(np.arange(k) % 2 == 0, 1.0, -1.0).astype(np.float32)
         * np.ones((num_rows, k), dtype=np.float32))
    x[0] = 1.0  # row 0: every product positive
    q, xd, xds = quantize_activations(x)
    assert np.abs(q).max() == 127
    codes = np.full((n, k), 15)
    out = torch.ops.aigw_cpu.q_linear(torch.from_numpy(x), interleave_q4_1(
                                          torch.from_numpy(_q4_1_rows(codes, 0.5, -4.0))),
                                      native.WEIGHT_TYPES["Q4_1x8"], None, 0.0, False)
    sums = exact_sums(codes[None].repeat(num_rows, 0).reshape(num_rows, n, -1, QK),
                      q.reshape(num_rows, 1, -1, QK))  # [M, N, nb]
    expected = (sums * 0.5 * xd[:, None, :] + -4.0 * xds[:, None, :]).sum(-1)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-3)
    w8 = np.full((n, k), -128)
    out8 = torch.ops.aigw_cpu.q_linear(torch.from_numpy(x),
                                       interleave_q8_0(torch.from_numpy(_q8_0_rows(w8, 0.25))),
                                       native.WEIGHT_TYPES["Q8_0x8"], None, 0.0, False)
    sums8 = exact_sums(w8[None].repeat(num_rows, 0).reshape(num_rows, n, -1, QK),
                       q.reshape(num_rows, 1, -1, QK))
    np.testing.assert_allclose(out8.numpy(), (sums8 * 0.25 * xd[:, None, :]).sum(-1), rtol=1e-5,
                               atol=1e-3)


def kernel_outputs() -> dict[str, list[float]]:
    """Every op of the kernels on fixed inputs (Q4_1 and Q8_0 at 1, 5 and 70 rows, fused norm and
    SiLU forms, decode attention over a float16 cache)."""
    import gguf

    from engine.layers.native_linear import to_native_blocks

    gen = torch.Generator().manual_seed(11)
    rng = np.random.default_rng(11)
    outputs: dict[str, list[float]] = {}
    for ggml_type in ("Q4_1", "Q8_0"):
        weight = rng.standard_normal((64, 192)).astype(np.float32) * 0.1
        qtype = getattr(gguf.GGMLQuantizationType, ggml_type)
        blocks, wtype = to_native_blocks(ggml_type, gguf.quants.quantize(weight, qtype))
        for rows in (1, 5, 70):
            x = torch.randn(rows, 384, generator=gen)
            norm = torch.rand(192, generator=gen) + 0.5
            outputs[f"{ggml_type}/{rows}"] = torch.ops.aigw_cpu.q_linear(
                x[:, :192], blocks, wtype, None, 0.0, False).flatten().tolist()
            outputs[f"{ggml_type}/{rows}/norm"] = torch.ops.aigw_cpu.q_linear(
                x[:, :192], blocks, wtype, norm, 1e-5, False).flatten().tolist()
            outputs[f"{ggml_type}/{rows}/silu"] = torch.ops.aigw_cpu.q_linear(
                x, blocks, wtype, None, 0.0, True).flatten().tolist()
    heads, kv_heads, dh, bs = 6, 2, 32, 4
    cache = torch.randn(10, bs, kv_heads, dh, generator=gen).to(torch.float16)
    k_cache, v_cache = (cache.clone(),
                        torch.randn(10, bs, kv_heads, dh, generator=gen).to(torch.float16))
    positions = torch.tensor([9, 3, 4])
    tables = torch.tensor([[3, 7, 1], [5, 2, 0], [5, 2, 0]])
    slots = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dh, generator=gen)
    angles = torch.arange(16)[:, None] * torch.rand(dh, generator=gen)[None]
    outputs["attention"] = torch.ops.aigw_cpu.decode_attention(
        qkv, angles.cos(), angles.sin(), positions, k_cache, v_cache, slots, tables, positions + 1,
        heads, kv_heads, dh ** -0.5).flatten().tolist()
    return outputs
