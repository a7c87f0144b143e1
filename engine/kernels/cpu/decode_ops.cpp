// Native CPU kernels (AVX2 + FMA + F16C; VNNI dot products in the avx512_vnni / avx_vnni builds),
// registered as torch.ops.aigw_cpu.*.
//
// Built on first use by engine/kernels/cpu/__init__.py (torch.utils.cpp_extension.load), once per
// ISA variant with its flags (engine/kernels/cpu/isa.py); every variant gives the same results. They serve
// every row of the `--decode-weights q4` mode (decode rows and prefill chunks, a row per token) and
// the float32 mode's decode attention:
//
//   q_linear        out[M, N] = prep(x)[M, K] @ W^T, W in the GGUF's blocks, interleaved by 8 output
//                   columns at load: Q4_1 (w = q * d + m; Q4_0 converted to it; dot_q4x8) or Q8_0
//                   (w = q * d; dot_q8x8). prep = optional RMSNorm, or silu(x[:, :K]) * x[:, K:].
//                   Activations are quantized to 8 bits per 32-value block (llama.cpp's Q8_1), and
//                   each block's dot product runs in 8/16/32-bit integers. From 4 rows (decode
//                   steps of several rows, prefill) the Q4 kernel reads pre-broadcast activations,
//                   4 rows x 16 columns at a time (dot_q4x16_expanded), same results.
//   q_linear_add_   the same, added into `out` in place (the residual stream).
//   dequantize_bf16 column groups of a Q4_1 / Q8_0 weight -> bfloat16 rows (the bf16 prefill GEMMs).
//   decode_attention  one token per row: rotary on q and k, store k/v into the paged cache (float32
//                   or float16), attend over the row's context (its positions up to its own) straight
//                   from the cache blocks (no gather); a prefill chunk's rows share passes over K/V.
//
// Every row is computed on its own, in the same order whatever else is in the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QK = 32;          // values per block
#ifndef EXPANDED_MIN_ROWS
#define EXPANDED_MIN_ROWS 4  // q_linear rows from which the Q4 kernel reads pre-broadcast activations
#endif
#ifndef ATTN_TILE_ROWS
#define ATTN_TILE_ROWS 16  // attention rows of one sequence that share each pass over its K/V
#endif
#ifndef ATTN_CHUNK
#define ATTN_CHUNK 128  // context positions per pass (a multiple of 4)
#endif
#ifndef ATTN_ROW_CHUNK
#define ATTN_ROW_CHUNK 32  // the same for a tile of one row (a decode row)
#endif
#ifndef ATTN_PREFETCH
#define ATTN_PREFETCH 2  // chunks of a decode row's K/V prefetched ahead
#endif
#ifndef ATTN_MIN_TILES_PER_THREAD
#define ATTN_MIN_TILES_PER_THREAD 4  // from this many tiles a thread, an attention task takes all kv heads
#endif
constexpr int64_t TYPE_Q8X8 = 1;   // Q8_0 interleaved by 8 output columns (see dot_q8x8)
constexpr int64_t Q8X8_BYTES = 272; // per 8 columns x 32 inputs: d f16[8] | 256 int8
constexpr int64_t TYPE_Q4X8 = 2;    // Q4_1 interleaved by 8 output columns (see dot_q4x8)
constexpr int64_t Q4X8_BYTES = 160; // per 8 columns x 32 inputs: d f16[8] | m f16[8] | 128 nibble bytes

inline int32_t load_i32(const int32_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  lo = _mm_add_ss(lo, sh);
  return _mm_cvtss_f32(lo);
}

// One activation row quantized: 32 int8 per block, block scale d and d * sum(q).
struct QRow {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> ds;
};

// e^x, Cephes-style: 2^n * p(r); relative error ~1e-7 (x clamped to [-87.3, 88.3]).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// A block's integer dot product, 4 u8 x s8 products per 32-bit lane, summed over the block's vectors:
// AVX2 pairs them in int16 (maddubs; exact, the sums stay below 2^15: Q4 codes <= 15, |Q8| <= 128
// against |x| <= 127, 8 vectors) and widens at the end (madd with ones); the VNNI variants
// (DECODE_OPS_VNNI, engine/kernels/cpu/isa.py) accumulate straight into int32 (vpdpbusd). Same integers.
#if defined(DECODE_OPS_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i dp_first(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
inline __m256i dp_next(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
inline __m256i dp_total(__m256i acc) { return acc; }
#elif defined(DECODE_OPS_VNNI) && defined(__AVXVNNI__)
inline __m256i dp_first(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
inline __m256i dp_next(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline __m256i dp_total(__m256i acc) { return acc; }
#elif defined(DECODE_OPS_VNNI)
#error "DECODE_OPS_VNNI needs -mavx512vnni -mavx512vl or -mavxvnni"
#else
inline __m256i dp_first(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }
inline __m256i dp_next(__m256i acc, __m256i u, __m256i s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
inline __m256i dp_total(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#endif

// prep(x row) -> int8 blocks. mode 0: plain, 1: rms norm with weight, 2: silu(x[:K]) * x[K:].
// Vectorised (AVX2); rounding is round-half-even like std::nearbyint.
void quantize_row(const float* x, int64_t k, int mode, const float* norm_w, float eps, int8_t* q,
                  float* d, float* ds, float* tmp) {
  const float* src = x;
  if (mode == 1) {
    float acc = 0.f;
    for (int64_t i = 0; i < k; ++i) acc += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(acc / static_cast<float>(k) + eps);
    for (int64_t i = 0; i < k; ++i) tmp[i] = norm_w[i] * (x[i] * inv);
    src = tmp;
  } else if (mode == 2) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < k; i += 8) {  // k a multiple of 32
      const __m256 g = _mm256_loadu_ps(x + i);
      const __m256 e = exp_ps(_mm256_xor_ps(g, sign));  // e^-g
      _mm256_storeu_ps(tmp + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(x + k + i)));
    }
    src = tmp;
  }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / QK; ++b) {
    const float* v = src + b * QK;
    __m256 v4[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v4[j] = _mm256_loadu_ps(v + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v4[j], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.f;
    const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    __m256i i4[4];
    for (int j = 0; j < 4; ++j) {
      i4[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v4[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    const int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(i4[0], i4[1]), _mm256_add_epi32(i4[2], i4[3])));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i4[0], i4[1]), _mm256_packs_epi32(i4[2], i4[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), _mm256_permutevar8x32_epi32(packed, perm));
    d[b] = scale;
    ds[b] = scale * static_cast<float>(sum);
  }
}

// Q8_0 interleaved like dot_q4x8 (Q8X8_BYTES per 8 columns and block: d f16[8] | 8 x 32 int8, lane j
// of vector u holding column j's inputs 4u..4u+3). Signed x signed through maddubs: |w| times
// x * sign(w); a pair of products needs the whole int16 range, so each is widened to int32 at once.
// (`xds`, the activations' d * sum, only matters for Q4_1's offset m: unused here, kept so both
// kernels share one signature.)
template <int R>
inline void dot_q8x8(const uint8_t* w, int64_t nb, const int8_t* const* xq_in, const float* const* xd_in,
                     const float* const* /*xds_in*/, __m256* acc_out) {
  // Accumulators and row pointers are locals: stores through __m256* (may_alias) would make the
  // compiler reload the row pointers and store the accumulators every block.
  const int8_t* xq[R];
  const float* xd[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = xq_in[r];
    xd[r] = xd_in[r];
  }
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * Q8X8_BYTES;
    const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256i* wq = reinterpret_cast<const __m256i*>(blk + 16);
    __m256i aw[8];
    for (int u = 0; u < 8; ++u) aw[u] = _mm256_abs_epi8(_mm256_loadu_si256(wq + u));
    for (int r = 0; r < R; ++r) {
      const int32_t* quad = reinterpret_cast<const int32_t*>(xq[r] + b * QK);
      __m256i s32 = _mm256_setzero_si256();
      for (int u = 0; u < 8; ++u) {
        const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(quad + u)), _mm256_loadu_si256(wq + u));
#if defined(DECODE_OPS_VNNI)
        s32 = dp_next(s32, aw[u], sx);  // the pair sums need all of int16: no int16 chain here
#else
        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[u], sx), ones));
#endif
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(wd, _mm256_set1_ps(xd[r][b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) acc_out[r] = acc[r];
}

// 8 output columns x R activation rows (R <= 4), weights interleaved for 32-bit lanes: in each of
// the 4 nibble vectors of a block, lane j holds column j's inputs 8t..8t+3 (low nibbles) and
// 8t+4..8t+7 (high nibbles). A lane's 4 products sum in maddubs; 8 of those sums stay exact in int16.
template <int R>
inline void dot_q4x8(const uint8_t* w, int64_t nb, const int8_t* const* xq_in, const float* const* xd_in,
                     const float* const* xds_in, __m256* acc_out) {
  // Accumulators and row pointers are locals: stores through __m256* (may_alias) would make the
  // compiler reload the row pointers and store the accumulators every block.
  const int8_t* xq[R];
  const float* xd[R];
  const float* xds[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = xq_in[r];
    xd[r] = xd_in[r];
    xds[r] = xds_in[r];
  }
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * Q4X8_BYTES;
    const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    __m256i q[8];
    for (int t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * t));
      q[2 * t] = _mm256_and_si256(v, low);
      q[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const int32_t* quad = reinterpret_cast<const int32_t*>(xq[r] + b * QK);  // 8 x 4 inputs
      __m256i s16 = dp_first(q[0], _mm256_set1_epi32(load_i32(quad)));
      for (int u = 1; u < 8; ++u) s16 = dp_next(s16, q[u], _mm256_set1_epi32(load_i32(quad + u)));
      const __m256 f = _mm256_cvtepi32_ps(dp_total(s16));
      acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(wd, _mm256_set1_ps(xd[r][b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xds[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) acc_out[r] = acc[r];
}

// Many-row form of dot_q4x8 (EXPANDED_MIN_ROWS rows and more): the tile's activations come
// pre-broadcast (expand_rows), so each quad folds into maddubs as a memory operand (on Zen 3 a
// broadcast from memory costs a vector-pipe uop, and those pipes bound dot_q4x8). Full tiles of 4
// rows take dot_q4x16_expanded (below), this kernel the last rows (m % 4) and an odd last group.
// From 4 rows rather than 16 since dot_q4x16_expanded: 1.2-1.3x at 4 and 8 rows (one thread, hot
// weights), and at 4 concurrent requests a decode step 10% shorter (aigw bench engine, 2 rounds).
// Same operations in the same order as dot_q4x8, so a row comes out bit-identical from either.
constexpr int64_t XB_BYTES = 8 * 32 + 2 * 32;  // per row and block: 8 quads x 8 lanes | d x 8 | d*sum x 8
#ifndef XB_TILE_BYTES
#define XB_TILE_BYTES (256 * 1024)  // 4 expanded rows at most this big (L2 is 512 KB): K <= 6,528
#endif

void expand_rows(const int8_t* q, const float* d, const float* ds, int64_t rows, int64_t k, uint8_t* xb) {
  const int64_t nb = k / QK;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t* quad = reinterpret_cast<const int32_t*>(q + r * k + b * QK);
      __m256i* dst = reinterpret_cast<__m256i*>(xb + (r * nb + b) * XB_BYTES);
      for (int u = 0; u < 8; ++u) _mm256_store_si256(dst + u, _mm256_set1_epi32(load_i32(quad + u)));
      _mm256_store_ps(reinterpret_cast<float*>(dst + 8), _mm256_set1_ps(d[r * nb + b]));
      _mm256_store_ps(reinterpret_cast<float*>(dst + 9), _mm256_set1_ps(ds[r * nb + b]));
    }
  }
}

template <int R>
inline void dot_q4x8_expanded(const uint8_t* w, int64_t nb, const uint8_t* const* xb_in, __m256* acc_out) {
  const uint8_t* xb[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xb[r] = xb_in[r];
    acc[r] = _mm256_setzero_ps();
  }
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * Q4X8_BYTES;
    const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    __m256i q[8];
    for (int t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * t));
      q[2 * t] = _mm256_and_si256(v, low);
      q[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i* xv = reinterpret_cast<const __m256i*>(xb[r] + b * XB_BYTES);  // 8 x 4 inputs
      __m256i s16 = dp_first(q[0], _mm256_load_si256(xv));
      for (int u = 1; u < 8; ++u) s16 = dp_next(s16, q[u], _mm256_load_si256(xv + u));
      const __m256 f = _mm256_cvtepi32_ps(dp_total(s16));
      const __m256 xd = _mm256_load_ps(reinterpret_cast<const float*>(xv + 8));
      const __m256 xds = _mm256_load_ps(reinterpret_cast<const float*>(xv + 9));
      acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(wd, xd), acc[r]);
      acc[r] = _mm256_fmadd_ps(wm, xds, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) acc_out[r] = acc[r];
}

// dot_q4x8_expanded for a tile of 4 rows x 2 column groups (16 columns): each pre-broadcast
// activation vector is loaded once and feeds the maddubs of both groups, which halves the vector
// loads, the bound of the one-group kernel on Zen 3 (it takes ~43 cycles a block of 4 rows, measured;
// llvm-mca -mcpu=znver3 finds its vector-load ports full; this one ~30 a group by llvm-mca, against
// ~26 for the vector pipes alone). The 8 int16 sums stay in
// registers; the empty asm statements pin them and the loaded activation, or GCC reassociates the
// int16 adds into trees over stored partial products and folds each load into both maddubs, which
// spills (measured slower than the one-group kernel). The float accumulators live in `acc` (4 rows x
// 16 floats, L1), updated once a block. Same operations in the same order as dot_q4x8 per output
// element, so results are bit-identical to both other Q4 kernels.
inline void dot_q4x16_expanded(const uint8_t* w0, const uint8_t* w1, int64_t nb, const uint8_t* const* xb,
                               float* acc) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 64; i += 8) _mm256_store_ps(acc + i, _mm256_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = w0 + b * Q4X8_BYTES;
    const uint8_t* b1 = w1 + b * Q4X8_BYTES;
    const __m256i* x0 = reinterpret_cast<const __m256i*>(xb[0] + b * XB_BYTES);
    const __m256i* x1 = reinterpret_cast<const __m256i*>(xb[1] + b * XB_BYTES);
    const __m256i* x2 = reinterpret_cast<const __m256i*>(xb[2] + b * XB_BYTES);
    const __m256i* x3 = reinterpret_cast<const __m256i*>(xb[3] + b * XB_BYTES);
    __m256i s00, s01, s10, s11, s20, s21, s30, s31;  // s<row><group>
#define AIGW_Q4X16_ROW(SA, SB, XR, QA, QB, U, FIRST)                                               \
  {                                                                                               \
    __m256i x = _mm256_load_si256(XR + (U));                                                      \
    asm("" : "+x"(x));                                                                            \
    if (FIRST) {                                                                                  \
      SA = dp_first(QA, x);                                                                       \
      SB = dp_first(QB, x);                                                                       \
    } else {                                                                                      \
      SA = dp_next(SA, QA, x);                                                                    \
      SB = dp_next(SB, QB, x);                                                                    \
    }                                                                                             \
  }
#define AIGW_Q4X16_STEP(QA, QB, U, FIRST)                                                         \
  {                                                                                               \
    const __m256i qa = (QA), qb = (QB);                                                           \
    AIGW_Q4X16_ROW(s00, s01, x0, qa, qb, U, FIRST)                                                \
    AIGW_Q4X16_ROW(s10, s11, x1, qa, qb, U, FIRST)                                                \
    AIGW_Q4X16_ROW(s20, s21, x2, qa, qb, U, FIRST)                                                \
    AIGW_Q4X16_ROW(s30, s31, x3, qa, qb, U, FIRST)                                                \
    asm("" : "+x"(s00), "+x"(s01), "+x"(s10), "+x"(s11), "+x"(s20), "+x"(s21), "+x"(s30), "+x"(s31)); \
  }
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 32 + 32 * t));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 32 + 32 * t));
      AIGW_Q4X16_STEP(_mm256_and_si256(v0, low), _mm256_and_si256(v1, low), 2 * t, t == 0)
      AIGW_Q4X16_STEP(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                      _mm256_and_si256(_mm256_srli_epi16(v1, 4), low), 2 * t + 1, false)
    }
#undef AIGW_Q4X16_STEP
#undef AIGW_Q4X16_ROW
    const __m256 wd0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0)));
    const __m256 wm0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 16)));
    const __m256 wd1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1)));
    const __m256 wm1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + 16)));
    const __m256i* xr[4] = {x0, x1, x2, x3};
    const __m256i sums[4][2] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}};
    for (int r = 0; r < 4; ++r) {
      const float* xs = reinterpret_cast<const float*>(xr[r] + 8);  // d x 8 | d*sum x 8
      const __m256 xd = _mm256_load_ps(xs), xds = _mm256_load_ps(xs + 8);
      float* a = acc + 16 * r;
      __m256 a0 = _mm256_load_ps(a), a1 = _mm256_load_ps(a + 8);
      a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp_total(sums[r][0])), _mm256_mul_ps(wd0, xd), a0);
      a0 = _mm256_fmadd_ps(wm0, xds, a0);
      a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp_total(sums[r][1])), _mm256_mul_ps(wd1, xd), a1);
      a1 = _mm256_fmadd_ps(wm1, xds, a1);
      _mm256_store_ps(a, a0);
      _mm256_store_ps(a + 8, a1);
    }
  }
}

// out[M, N] (= or +=) with the expanded Q4 kernels: each thread takes a range of column-group pairs
// and walks the rows 4 at a time, expanding them once and running them against all its groups (the
// weights stream from L2/L3, the expanded rows stay in L1/L2). Full 4-row tiles take two groups at a
// time (dot_q4x16_expanded); a last odd group and the last rows (m % 4) take dot_q4x8_expanded.
void for_row_tiles_expanded(const uint8_t* wp, int64_t group_bytes, int64_t n, int64_t m, int64_t k,
                            int64_t nb, const std::vector<int8_t>& q, const std::vector<float>& d,
                            const std::vector<float>& ds, float* op, bool accumulate) {
  const int64_t groups = n / 8;
  at::parallel_for(0, (groups + 1) / 2, 2, [&](int64_t pair_begin, int64_t pair_end) {
    const int64_t begin = 2 * pair_begin, end = std::min(groups, 2 * pair_end);
    uint8_t* xbuf = static_cast<uint8_t*>(std::aligned_alloc(64, 4 * nb * XB_BYTES));  // 320 | XB_BYTES
    alignas(32) float acc16[64];
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
      const int rows = static_cast<int>(std::min<int64_t>(4, m - r0));
      expand_rows(q.data() + r0 * k, d.data() + r0 * nb, ds.data() + r0 * nb, rows, k, xbuf);
      const uint8_t* xb[4];
      for (int i = 0; i < rows; ++i) xb[i] = xbuf + i * nb * XB_BYTES;
      for (int64_t g = begin; g < end;) {
        const uint8_t* wg = wp + g * group_bytes;
        const bool pair = rows == 4 && g + 1 < end;
        const int64_t next = g + (pair ? 2 : 1);
        if (next < end) {  // the next weights on their way from memory while these compute
          const char* ahead = reinterpret_cast<const char*>(wp + next * group_bytes);
          const int64_t bytes = (next + 1 < end ? 2 : 1) * group_bytes;
          for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
        if (pair) {
          dot_q4x16_expanded(wg, wg + group_bytes, nb, xb, acc16);
          for (int i = 0; i < 4; ++i) {
            float* dst = op + (r0 + i) * n + g * 8;
            for (int h = 0; h < 2; ++h) {
              const __m256 a = _mm256_load_ps(acc16 + 16 * i + 8 * h);
              _mm256_storeu_ps(dst + 8 * h, accumulate ? _mm256_add_ps(_mm256_loadu_ps(dst + 8 * h), a) : a);
            }
          }
        } else {
          __m256 acc[4];
          switch (rows) {
            case 4: dot_q4x8_expanded<4>(wg, nb, xb, acc); break;
            case 3: dot_q4x8_expanded<3>(wg, nb, xb, acc); break;
            case 2: dot_q4x8_expanded<2>(wg, nb, xb, acc); break;
            default: dot_q4x8_expanded<1>(wg, nb, xb, acc); break;
          }
          for (int i = 0; i < rows; ++i) {
            float* dst = op + (r0 + i) * n + g * 8;
            const __m256 v = accumulate ? _mm256_add_ps(_mm256_loadu_ps(dst), acc[i]) : acc[i];
            _mm256_storeu_ps(dst, v);
          }
        }
        g = next;
      }
    }
    std::free(xbuf);
  });
}

using GroupKernel = void (*)(const uint8_t*, int64_t, const int8_t* const*, const float* const*,
                            const float* const*, __m256*);

// out[M, N] (= or +=) for every group of 8 columns, rows in tiles of 4 (the weight block stays in
// registers across a tile's rows).
void for_column_groups(GroupKernel k4, GroupKernel k3, GroupKernel k2, GroupKernel k1, const uint8_t* wp,
                       int64_t group_bytes, int64_t n, int64_t m, int64_t k, int64_t nb,
                       const std::vector<int8_t>& q, const std::vector<float>& d,
                       const std::vector<float>& ds, float* op, bool accumulate) {
  at::parallel_for(0, n / 8, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* wg = wp + g * group_bytes;
      if (g + 1 < end) {  // the next group's weights on their way from memory while this one computes
        const char* next = reinterpret_cast<const char*>(wg + group_bytes);
        for (int64_t off = 0; off < group_bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      }
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, m - r0));
        const int8_t* xq[4];
        const float* xd[4];
        const float* xds[4];
        for (int i = 0; i < rows; ++i) {
          xq[i] = q.data() + (r0 + i) * k;
          xd[i] = d.data() + (r0 + i) * nb;
          xds[i] = ds.data() + (r0 + i) * nb;
        }
        __m256 acc[4];
        (rows == 4 ? k4 : rows == 3 ? k3 : rows == 2 ? k2 : k1)(wg, nb, xq, xd, xds, acc);
        for (int i = 0; i < rows; ++i) {
          float* dst = op + (r0 + i) * n + g * 8;
          const __m256 v = accumulate ? _mm256_add_ps(_mm256_loadu_ps(dst), acc[i]) : acc[i];
          _mm256_storeu_ps(dst, v);
        }
      }
    }
  });
}

// out[M, N] (= or +=) prep(x) @ W^T
void q_linear_into(const at::Tensor& x, const at::Tensor& w, int64_t wtype,
                   const c10::optional<at::Tensor>& norm_weight, double eps, bool silu_mul,
                   at::Tensor& out, bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte, "w must be [N, bytes_per_row] uint8");
  TORCH_CHECK(wtype == TYPE_Q8X8 || wtype == TYPE_Q4X8, "unknown weight type");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0);
  const int64_t k = silu_mul ? xc.size(1) / 2 : xc.size(1);
  TORCH_CHECK(k % QK == 0, "K must be a multiple of 32");
  const int64_t nb = k / QK;
  const int64_t row_bytes = nb * (wtype == TYPE_Q8X8 ? Q8X8_BYTES : Q4X8_BYTES);
  TORCH_CHECK(w.size(1) == row_bytes && w.is_contiguous(), "weight rows do not match K");
  const int64_t n = w.size(0) * 8;
  TORCH_CHECK(out.size(0) == m && out.size(1) == n && out.is_contiguous(), "bad out shape");
  const int mode = norm_weight.has_value() ? 1 : (silu_mul ? 2 : 0);
  at::Tensor nw;
  if (mode == 1) nw = norm_weight->contiguous();

  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * nb), ds(m * nb);
  const float* xp = xc.data_ptr<float>();
  const int64_t x_stride = xc.size(1);
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(k);
    for (int64_t r = begin; r < end; ++r) {
      quantize_row(xp + r * x_stride, k, mode, mode == 1 ? nw.data_ptr<float>() : nullptr,
                   static_cast<float>(eps), q.data() + r * k, d.data() + r * nb, ds.data() + r * nb,
                   tmp.data());
    }
  });

  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (wtype == TYPE_Q4X8) {
    if (m >= EXPANDED_MIN_ROWS && 4 * nb * XB_BYTES <= XB_TILE_BYTES) {
      for_row_tiles_expanded(wp, row_bytes, n, m, k, nb, q, d, ds, op, accumulate);
      return;
    }
    for_column_groups(dot_q4x8<4>, dot_q4x8<3>, dot_q4x8<2>, dot_q4x8<1>, wp, row_bytes, n, m, k, nb,
                      q, d, ds, op, accumulate);
  } else {
    for_column_groups(dot_q8x8<4>, dot_q8x8<3>, dot_q8x8<2>, dot_q8x8<1>, wp, row_bytes, n, m, k, nb,
                      q, d, ds, op, accumulate);
  }
}

at::Tensor q_linear(const at::Tensor& x, const at::Tensor& w, int64_t wtype,
                    const c10::optional<at::Tensor>& norm_weight, double eps, bool silu_mul) {
  const int64_t n = w.size(0) * 8;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  q_linear_into(x, w, wtype, norm_weight, eps, silu_mul, out, false);
  return out;
}

void q_linear_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t wtype,
                   bool silu_mul) {
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out must be float32");
  q_linear_into(x, w, wtype, c10::nullopt, 0.0, silu_mul, out, true);
}

// 8 float32 -> bfloat16 bits in the low 16 of each 32-bit lane, round to nearest even (the weights
// are finite: no NaN case).
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

// 16 float32 (a then b) -> 16 bfloat16.
inline __m256i to_bf16x16(__m256 a, __m256 b) {
  const __m256i packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));  // a0-3 b0-3 | a4-7 b4-7
  return _mm256_permute4x64_epi64(packed, 0xD8);  // a0-7 b0-7
}

// One block (32 inputs) of a group's 8 columns -> out rows dst[j * k + 0..31], j < 8. Both layouts
// give, for t < 4, a pair of vectors (A_t, B_t) whose 32-bit lane j holds column j's inputs
// 8t..8t+3 (A) and 8t+4..8t+7 (B): Q4_1 (dot_q4x8) the low and high nibbles of nibble vector t,
// Q8_0 (dot_q8x8) vectors 2t and 2t + 1. unpacklo/hi_epi32(A, B) then hold 8 consecutive inputs
// of columns (0, 1 | 4, 5) and (2, 3 | 6, 7), 8 bytes each.
template <bool Q4>
inline void dequantize_block(const uint8_t* blk, int64_t k, uint16_t* dst) {
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk);
  __m128i bytes[4][8];  // [t][column]: 8 codes (low 8 bytes)
  for (int t = 0; t < 4; ++t) {
    __m256i a, b;
    if (Q4) {
      const __m256i low = _mm256_set1_epi8(0x0F);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * t));
      a = _mm256_and_si256(v, low);
      b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    } else {
      a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 64 * t));
      b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 48 + 64 * t));
    }
    const __m256i p0 = _mm256_unpacklo_epi32(a, b), p1 = _mm256_unpackhi_epi32(a, b);
    const __m128i p0l = _mm256_castsi256_si128(p0), p0h = _mm256_extracti128_si256(p0, 1);
    const __m128i p1l = _mm256_castsi256_si128(p1), p1h = _mm256_extracti128_si256(p1, 1);
    bytes[t][0] = p0l;
    bytes[t][1] = _mm_unpackhi_epi64(p0l, p0l);
    bytes[t][2] = p1l;
    bytes[t][3] = _mm_unpackhi_epi64(p1l, p1l);
    bytes[t][4] = p0h;
    bytes[t][5] = _mm_unpackhi_epi64(p0h, p0h);
    bytes[t][6] = p1h;
    bytes[t][7] = _mm_unpackhi_epi64(p1h, p1h);
  }
  for (int j = 0; j < 8; ++j) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(scales[j]));
    const __m256 m = Q4 ? _mm256_set1_ps(_cvtsh_ss(scales[8 + j])) : _mm256_setzero_ps();
    __m256 f[4];
    for (int t = 0; t < 4; ++t) {
      const __m256i q = Q4 ? _mm256_cvtepu8_epi32(bytes[t][j]) : _mm256_cvtepi8_epi32(bytes[t][j]);
      f[t] = Q4 ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m) : _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * k), to_bf16x16(f[0], f[1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * k + 16), to_bf16x16(f[2], f[3]));
  }
}

// out[(g1 - g0) * 8, K] bfloat16 = the weight rows (output columns) of column groups [g0, g1): what
// the bf16 prefill GEMMs read (engine/layers/bf16_linear.py), a tile at a time into a bounded scratch.
void dequantize_bf16(const at::Tensor& w, int64_t wtype, int64_t g0, int64_t g1, at::Tensor& out) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N / 8, bytes] uint8");
  TORCH_CHECK(wtype == TYPE_Q8X8 || wtype == TYPE_Q4X8, "unknown weight type");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2, "out must be bf16 [rows, K]");
  TORCH_CHECK(0 <= g0 && g0 < g1 && g1 <= w.size(0), "column groups out of range");
  const int64_t block_bytes = wtype == TYPE_Q8X8 ? Q8X8_BYTES : Q4X8_BYTES;
  TORCH_CHECK(w.size(1) % block_bytes == 0, "weight rows are not whole blocks");
  const int64_t nb = w.size(1) / block_bytes;
  const int64_t k = nb * QK;
  TORCH_CHECK(out.size(0) == (g1 - g0) * 8 && out.size(1) == k, "out must be [(g1 - g0) * 8, K]");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(g0, g1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wp + g * w.size(1) + b * block_bytes;
        uint16_t* dst = op + (g - g0) * 8 * k + b * QK;
        if (wtype == TYPE_Q4X8) {
          dequantize_block<true>(blk, k, dst);
        } else {
          dequantize_block<false>(blk, k, dst);
        }
      }
    }
  });
}

// 8 cache values as float32: the cache holds float32 or float16 (uint16_t bits).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(uint16_t* dst, const float* src, int64_t n) {  // n a multiple of 8
  for (int64_t i = 0; i < n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  }
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {  // n a multiple of 8
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  return hsum(acc);
}

// scores[h * stride + t] = scale * q[h] . k_row(t) for t in [t0, t1), NH query heads (NH <= 3) sharing
// one kv head. Positions go in fours from t0 (a multiple of 4), the rest one by one: a row's scores
// come out the same whether its context is done in one range or in consecutive ranges of 4k.
template <typename T, int NH, typename RowFn>
inline void scores_heads(const float* q, int64_t dh, int64_t t0, int64_t t1, int64_t stride,
                         const RowFn& k_row, float scale, float* scores) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {  // 4 positions x NH heads of accumulators, one 4-way sum each
    const T* k4[4] = {k_row(t), k_row(t + 1), k_row(t + 2), k_row(t + 3)};
    __m256 acc[NH][4];
    for (int h = 0; h < NH; ++h) {
      for (int p = 0; p < 4; ++p) acc[h][p] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < dh; i += 8) {
      for (int p = 0; p < 4; ++p) {
        const __m256 kv = load8(k4[p] + i);
        for (int h = 0; h < NH; ++h) acc[h][p] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dh + i), kv, acc[h][p]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3]));
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      _mm_storeu_ps(scores + h * stride + t, _mm_mul_ps(s4, _mm_set1_ps(scale)));
    }
  }
  for (; t < t1; ++t) {
    for (int h = 0; h < NH; ++h) scores[h * stride + t] = dot(q + h * dh, k_row(t), dh) * scale;
  }
}

// out[h][d0, d0 + 8 NV) (+)= sum_{t in [t0, t1)} probs[h * stride + t] * v_row(t)[...], NH heads
// (NH <= 3): NH x NV accumulators, all in registers (NV a template argument: with a run-time count the
// compiler kept them on the stack, ~4x slower). `out` is overwritten when t0 == 0, else accumulated
// into. Each output value sums its terms in t order, so consecutive ranges give the same result as one.
template <typename T, int NH, int NV, typename RowFn>
inline void weighted_values_part(const float* probs, int64_t dh, int64_t d0, int64_t t0, int64_t t1,
                                 int64_t stride, const RowFn& v_row, float* out) {
  __m256 acc[NH][NV];
  for (int h = 0; h < NH; ++h) {
    for (int i = 0; i < NV; ++i) {
      acc[h][i] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + h * dh + d0 + 8 * i);
    }
  }
  for (int64_t t = t0; t < t1; ++t) {
    const T* vr = v_row(t) + d0;
    __m256 p[NH];
    for (int h = 0; h < NH; ++h) p[h] = _mm256_set1_ps(probs[h * stride + t]);
    for (int i = 0; i < NV; ++i) {
      const __m256 v = load8(vr + 8 * i);
      for (int h = 0; h < NH; ++h) acc[h][i] = _mm256_fmadd_ps(p[h], v, acc[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + h * dh + d0 + 8 * i, acc[h][i]);
  }
}

// The whole head dim (a multiple of 8) in parts of 32 values, then 8.
template <typename T, int NH, typename RowFn>
inline void weighted_values(const float* probs, int64_t dh, int64_t t0, int64_t t1, int64_t stride,
                            const RowFn& v_row, float* out) {
  int64_t d0 = 0;
  for (; d0 + 32 <= dh; d0 += 32) weighted_values_part<T, NH, 4>(probs, dh, d0, t0, t1, stride, v_row, out);
  for (; d0 < dh; d0 += 8) weighted_values_part<T, NH, 1>(probs, dh, d0, t0, t1, stride, v_row, out);
}

// s[0..n) -> softmax(s) in place.
inline void softmax_inplace(float* s, int64_t n) {
  __m256 peak8 = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) peak8 = _mm256_max_ps(peak8, _mm256_loadu_ps(s + j));
  __m128 p4 = _mm_max_ps(_mm256_castps256_ps128(peak8), _mm256_extractf128_ps(peak8, 1));
  p4 = _mm_max_ps(p4, _mm_movehl_ps(p4, p4));
  p4 = _mm_max_ss(p4, _mm_movehdup_ps(p4));
  float peak = _mm_cvtss_f32(p4);
  for (; j < n; ++j) peak = std::max(peak, s[j]);
  const __m256 pv = _mm256_set1_ps(peak);
  __m256 tv = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), pv));
    _mm256_storeu_ps(s + i, e);
    tv = _mm256_add_ps(tv, e);
  }
  float total = hsum(tv);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - peak);
    total += s[i];
  }
  const float inv = 1.f / total;
  for (int64_t k = 0; k < n; ++k) s[k] *= inv;
}

// x [Dh] rotated in place, Hugging Face rotate_half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
inline void rotate(float* x, const float* cos, const float* sin, int64_t dh) {
  const int64_t half = dh / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// qkv [M, (H + 2G) * Dh] -> attention output [M, H * Dh]; writes rotated k and v into the caches
// ([num_blocks, block_size, G, Dh] float32) at `slots` first.
template <typename T>
at::Tensor decode_attention_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                 const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache,
                                 const at::Tensor& slots, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, int64_t num_heads,
                                 int64_t num_kv_heads, double scale) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  const int64_t m = qkv.size(0);
  const int64_t dh = k_cache.size(3);
  const int64_t bs = k_cache.size(1);
  const int64_t g_heads = num_kv_heads;
  const int64_t r_per = num_heads / num_kv_heads;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * g_heads) * dh, "qkv width");
  TORCH_CHECK(dh % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "block_size must be a power of two");
  const int bs_shift = __builtin_ctzll(static_cast<uint64_t>(bs));
  at::Tensor qkv_c = qkv.contiguous();
  at::Tensor pos = positions.to(at::kLong).contiguous();
  at::Tensor sl = slots.to(at::kLong).contiguous();
  at::Tensor tables = block_tables.to(at::kLong).contiguous();
  at::Tensor lens = context_lens.to(at::kLong).contiguous();
  at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  at::Tensor out = at::empty({m, num_heads * dh}, qkv.options());
  const float* qp = qkv_c.data_ptr<float>();
  T* kc = static_cast<T*>(k_cache.data_ptr());
  T* vc = static_cast<T*>(v_cache.data_ptr());
  const int64_t width = (num_heads + 2 * g_heads) * dh;
  const int64_t table_width = tables.size(1);
  const int64_t* posp = pos.data_ptr<int64_t>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const float* cp = cos_c.data_ptr<float>();
  const float* sp = sin_c.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  // Stage 1: rotary k, store k and v (rows are independent).
  std::vector<float> rotated(dh);
  for (int64_t r = 0; r < m; ++r) {
    const float* row = qp + r * width;
    const float* c = cp + posp[r] * dh;
    const float* s = sp + posp[r] * dh;
    for (int64_t g = 0; g < g_heads; ++g) {
      std::memcpy(rotated.data(), row + (num_heads + g) * dh, dh * sizeof(float));
      rotate(rotated.data(), c, s, dh);
      store_row(kc + (slp[r] * g_heads + g) * dh, rotated.data(), dh);
      store_row(vc + (slp[r] * g_heads + g) * dh, row + (num_heads + g_heads + g) * dh, dh);
    }
  }
  // Stage 2: per task (a tile of rows and its kv heads, or one of them): the query heads of each row
  // against its context. A tile is up to ATTN_TILE_ROWS consecutive rows of one sequence (a prefill
  // chunk: the same blocks, positions p, p + 1, ...); its rows go through the context ATTN_CHUNK
  // positions at a time, so each chunk of K/V comes from memory once per tile, not once per row.
  // With ATTN_MIN_TILES_PER_THREAD tiles a thread or more (a decode step of many rows, a prefill
  // chunk) a task takes all kv heads of its tile and reads each chunk once for all of them: position
  // t's heads are G * Dh contiguous values, so a task streams whole cache blocks. The step's K/V
  // (~3 MB a layer at 32 rows of 128 positions) comes from memory, and read one kv head at a time
  // (a task per row and kv head) it took ~1.25x as long (bench/results/engine-cpu.md). Fewer tiles: a task
  // per tile and kv head, so one sequence still spreads over the threads. A one-row tile (a decode
  // row) walks its context 32 positions at a time and prefetches ATTN_PREFETCH chunks ahead (in
  // the engine-level A/B runs; alone, neither measured beyond the noise). Each row's arithmetic is
  // the same whatever the task split or the chunk size (see scores_heads, weighted_values). Tasks
  // are dealt to the threads in turn, not in contiguous ranges: a prefill chunk's rows have
  // contexts of 1..C positions.
  std::vector<int64_t> tile_start{0};
  for (int64_t r = 1; r < m; ++r) {
    const bool same_sequence = posp[r] == posp[r - 1] + 1 && lp[r] == lp[r - 1] + 1 &&
        std::memcmp(tp + r * table_width, tp + (r - 1) * table_width, table_width * sizeof(int64_t)) == 0;
    if (!same_sequence || r - tile_start.back() == ATTN_TILE_ROWS) tile_start.push_back(r);
  }
  const int64_t num_tiles = static_cast<int64_t>(tile_start.size());
  tile_start.push_back(m);
  const int64_t num_threads = at::get_num_threads();
  const int64_t heads_per_task = num_tiles >= ATTN_MIN_TILES_PER_THREAD * num_threads ? g_heads : 1;
  const int64_t tasks_per_tile = g_heads / heads_per_task;
  const int64_t num_tasks = num_tiles * tasks_per_tile;
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, num_tasks));
  const int64_t task_q_heads = heads_per_task * r_per;  // query heads of a task, per row
  at::parallel_for(0, num_workers, 1, [&](int64_t first_worker, int64_t end_worker) {
    std::vector<float> q, scores, acc;  // per tile row: rotated queries, probabilities, output
    std::vector<int64_t> offsets;
    for (int64_t worker = first_worker; worker < end_worker; ++worker)
    for (int64_t task = worker; task < num_tasks; task += num_workers) {
      const int64_t tile = task / tasks_per_tile;
      const int64_t g0 = (task % tasks_per_tile) * heads_per_task, g1 = g0 + heads_per_task;
      const int64_t r0 = tile_start[tile], r1 = tile_start[tile + 1], rows = r1 - r0;
      int64_t max_len = 0;
      for (int64_t r = r0; r < r1; ++r) max_len = std::max(max_len, lp[r]);
      // row i's query head (g - g0) * r_per + j at [(i * task_q_heads + (g - g0) * r_per + j) * dh]
      q.resize(rows * task_q_heads * dh);
      acc.resize(rows * task_q_heads * dh);
      scores.resize(rows * task_q_heads * max_len);  // the same index, times max_len
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = qp + r * width;
        const float* c = cp + posp[r] * dh;
        const float* s = sp + posp[r] * dh;
        for (int64_t h = 0; h < task_q_heads; ++h) {
          float* qh = q.data() + ((r - r0) * task_q_heads + h) * dh;
          std::memcpy(qh, row + (g0 * r_per + h) * dh, dh * sizeof(float));
          rotate(qh, c, s, dh);
        }
      }
      const int64_t* table = tp + r0 * table_width;  // every row of the tile has these blocks
      offsets.resize(max_len);  // element offset of (position t, kv head g0) in the caches
      for (int64_t t = 0; t < max_len; ++t) {
        offsets[t] = ((table[t >> bs_shift] * bs + (t & (bs - 1))) * g_heads + g0) * dh;
      }
      const int64_t chunk = rows == 1 ? ATTN_ROW_CHUNK : ATTN_CHUNK;  // any multiple of 4: same results
      const int64_t span_bytes = heads_per_task * dh * static_cast<int64_t>(sizeof(T));
      auto prefetch = [&](const T* cache, int64_t t0, int64_t t1) {  // positions [t0, t1), the task's heads
        if (rows > 1) return;  // a prefill tile reuses each chunk for its rows
        for (int64_t t = t0; t < std::min(t1, max_len); ++t) {
          const char* p = reinterpret_cast<const char*>(cache + offsets[t]);
          for (int64_t b = 0; b < span_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
        }
      };
      prefetch(kc, 0, ATTN_PREFETCH * chunk);
      for (int64_t t0 = 0; t0 < max_len; t0 += chunk) {
        prefetch(kc, t0 + ATTN_PREFETCH * chunk, t0 + (ATTN_PREFETCH + 1) * chunk);
        for (int64_t g = g0; g < g1; ++g) {
          auto k_row = [&](int64_t t) { return kc + offsets[t] + (g - g0) * dh; };
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t t1 = std::min(t0 + chunk, lp[r]);
            if (t1 <= t0) continue;
            for (int64_t j0 = 0; j0 < r_per; j0 += 3) {  // query heads in threes: each K row read once
              const int nh = static_cast<int>(std::min<int64_t>(3, r_per - j0));
              const int64_t h = (r - r0) * task_q_heads + (g - g0) * r_per + j0;
              const float* qj = q.data() + h * dh;
              float* sj = scores.data() + h * max_len;
              switch (nh) {
                case 3: scores_heads<T, 3>(qj, dh, t0, t1, max_len, k_row, sc, sj); break;
                case 2: scores_heads<T, 2>(qj, dh, t0, t1, max_len, k_row, sc, sj); break;
                default: scores_heads<T, 1>(qj, dh, t0, t1, max_len, k_row, sc, sj); break;
              }
            }
          }
        }
      }
      prefetch(vc, 0, ATTN_PREFETCH * chunk);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t h = 0; h < task_q_heads; ++h) {
          softmax_inplace(scores.data() + ((r - r0) * task_q_heads + h) * max_len, lp[r]);
        }
      }
      for (int64_t t0 = 0; t0 < max_len; t0 += chunk) {
        prefetch(vc, t0 + ATTN_PREFETCH * chunk, t0 + (ATTN_PREFETCH + 1) * chunk);
        for (int64_t g = g0; g < g1; ++g) {
          auto v_row = [&](int64_t t) { return vc + offsets[t] + (g - g0) * dh; };
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t t1 = std::min(t0 + chunk, lp[r]);
            if (t1 <= t0) continue;
            for (int64_t j0 = 0; j0 < r_per; j0 += 3) {
              const int nh = static_cast<int>(std::min<int64_t>(3, r_per - j0));
              const int64_t h = (r - r0) * task_q_heads + (g - g0) * r_per + j0;
              const float* pj = scores.data() + h * max_len;
              float* oj = acc.data() + h * dh;
              switch (nh) {
                case 3: weighted_values<T, 3>(pj, dh, t0, t1, max_len, v_row, oj); break;
                case 2: weighted_values<T, 2>(pj, dh, t0, t1, max_len, v_row, oj); break;
                default: weighted_values<T, 1>(pj, dh, t0, t1, max_len, v_row, oj); break;
              }
            }
          }
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        std::memcpy(op + r * num_heads * dh + g0 * r_per * dh, acc.data() + (r - r0) * task_q_heads * dh,
                    task_q_heads * dh * sizeof(float));
      }
    }
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                            double scale) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat, "float32 activations");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "one cache dtype");
  if (k_cache.scalar_type() == at::kHalf) {
    return decode_attention_impl<uint16_t>(qkv, cos, sin, positions, k_cache, v_cache, slots,
                                           block_tables, context_lens, num_heads, num_kv_heads, scale);
  }
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "float32 or float16 cache");
  return decode_attention_impl<float>(qkv, cos, sin, positions, k_cache, v_cache, slots, block_tables,
                                      context_lens, num_heads, num_kv_heads, scale);
}

}  // namespace

TORCH_LIBRARY(aigw_cpu, m) {
  m.def("q_linear(Tensor x, Tensor w, int wtype, Tensor? norm_weight, float eps, bool silu_mul) -> Tensor");
  m.def("q_linear_add_(Tensor(a!) out, Tensor x, Tensor w, int wtype, bool silu_mul) -> ()");
  m.def("decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots, Tensor block_tables, Tensor context_lens, int num_heads, "
        "int num_kv_heads, float scale) -> Tensor");
  m.def("dequantize_bf16(Tensor w, int wtype, int group_begin, int group_end, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(aigw_cpu, CPU, m) {
  m.impl("q_linear", &q_linear);
  m.impl("q_linear_add_", &q_linear_add_);
  m.impl("decode_attention", &decode_attention);
  m.impl("dequantize_bf16", &dequantize_bf16);
}
