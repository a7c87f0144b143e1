// This CPU's ceilings, one thread: the clock, VPMADDUBSW and FMA throughput. They bound what any
// kernel can reach here (bench/results/engine-cpu.md, "This CPU's ceilings"). Not part of the package.
//
//   g++ -O2 -mavx2 -mfma -o /tmp/cpu_peak bench/cpu_peak.cpp && /tmp/cpu_peak
//   (/tmp/cpu_peak & /tmp/cpu_peak; wait)     # both cores at once
//
// clock: a chain of dependent integer adds (1 cycle each). maddubs: 8 independent chains of
// _mm256_maddubs_epi16 (32 u8 x s8 multiply-adds each, counted as 64 ops). fma: 10 independent
// chains of _mm256_fmadd_ps (8 multiply-adds, 16 FLOP). Registers are pinned with empty asm so the
// compiler keeps every chain in a register and cannot fold the loop.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

static double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

#define KEEP(v) asm volatile("" : "+x"(v))

int main() {
  const long adds = 400000000;
  uint64_t x = 1;
  double t = now_s();
  for (long i = 0; i < adds; ++i) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double ghz = 4.0 * adds / (now_s() - t) / 1e9;
  std::printf("clock        ~%.2f GHz (dependent adds)\n", ghz);

  const long iters = 100000000;
  __m256i a0 = _mm256_set1_epi8(1), a1 = _mm256_set1_epi8(2), a2 = _mm256_set1_epi8(3), a3 = _mm256_set1_epi8(4);
  __m256i a4 = _mm256_set1_epi8(5), a5 = _mm256_set1_epi8(6), a6 = _mm256_set1_epi8(7), a7 = _mm256_set1_epi8(8);
  const __m256i b = _mm256_set1_epi8(3);
  t = now_s();
  for (long i = 0; i < iters; ++i) {
    a0 = _mm256_maddubs_epi16(b, a0); a1 = _mm256_maddubs_epi16(b, a1);
    a2 = _mm256_maddubs_epi16(b, a2); a3 = _mm256_maddubs_epi16(b, a3);
    a4 = _mm256_maddubs_epi16(b, a4); a5 = _mm256_maddubs_epi16(b, a5);
    a6 = _mm256_maddubs_epi16(b, a6); a7 = _mm256_maddubs_epi16(b, a7);
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5); KEEP(a6); KEEP(a7);
  }
  double s = now_s() - t;
  std::printf("maddubs ymm  %.2f a cycle, %.0f GOP/s\n", 8.0 * iters / s / (ghz * 1e9), 8.0 * iters * 64 / s / 1e9);

  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  __m256 f0 = _mm256_set1_ps(1), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0, f8 = f0, f9 = f0;
  t = now_s();
  for (long i = 0; i < iters; ++i) {
    f0 = _mm256_fmadd_ps(f0, m, c); f1 = _mm256_fmadd_ps(f1, m, c); f2 = _mm256_fmadd_ps(f2, m, c);
    f3 = _mm256_fmadd_ps(f3, m, c); f4 = _mm256_fmadd_ps(f4, m, c); f5 = _mm256_fmadd_ps(f5, m, c);
    f6 = _mm256_fmadd_ps(f6, m, c); f7 = _mm256_fmadd_ps(f7, m, c); f8 = _mm256_fmadd_ps(f8, m, c);
    f9 = _mm256_fmadd_ps(f9, m, c);
    KEEP(f0); KEEP(f1); KEEP(f2); KEEP(f3); KEEP(f4); KEEP(f5); KEEP(f6); KEEP(f7); KEEP(f8); KEEP(f9);
  }
  s = now_s() - t;
  std::printf("fma ymm      %.2f a cycle, %.0f GFLOP/s\n", 10.0 * iters / s / (ghz * 1e9), 10.0 * iters * 16 / s / 1e9);
  std::printf("(checks %d %.3f)\n", _mm256_extract_epi16(a0, 0) + _mm256_extract_epi16(a7, 0), f0[0] + f9[0]);
}
