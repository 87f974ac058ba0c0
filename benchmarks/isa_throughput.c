// Peak multiply-add rates of one core: float32 FMA (vfmadd231ps zmm), AVX512-BF16 (vdpbf16ps zmm) and AMX-BF16
// (tdpbf16ps, four 16x16 float32 tiles, K = 32). Independent accumulators, no memory traffic: an upper bound for
// kernels, for telling how far a CPU's dot-product units outrun each other (docs/benchmarks.md, "An AMX machine").
// Build and run (gcc >= 11):  gcc -O2 -march=sapphirerapids benchmarks/isa_throughput.c -o /tmp/isa && /tmp/isa
// Each part runs only where CPUID lists its instructions (AMX also needs the kernel's arch_prctl permission).
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static const long kIters = 50000000;

static void fma_rate(void) {
  __m512 f[12], a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
  for (int i = 0; i < 12; i++) f[i] = _mm512_set1_ps((float)i);
  double t = now();
  for (long n = 0; n < kIters; n++) {
    for (int i = 0; i < 12; i++) f[i] = _mm512_fmadd_ps(f[i], a, b);
    __asm__ volatile("" ::"v"(a), "v"(b));
  }
  t = now() - t;
  float s = 0;
  for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(f[i]);
  printf("{\"op\": \"vfmadd231ps zmm\", \"ginst_per_s\": %.3f, \"gmac_per_s\": %.1f, \"check\": %g}\n",
         kIters * 12 / t / 1e9, kIters * 12 * 16 / t / 1e9, s);
}

static void dpbf16_rate(void) {
  __m512 acc[12];
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
  for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i);
  double t = now();
  for (long n = 0; n < kIters; n++) {
    for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" ::"v"(a), "v"(b));
  }
  t = now() - t;
  float s = 0;
  for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(acc[i]);
  printf("{\"op\": \"vdpbf16ps zmm\", \"ginst_per_s\": %.3f, \"gmac_per_s\": %.1f, \"check\": %g}\n",
         kIters * 12 / t / 1e9, kIters * 12 * 32 / t / 1e9, s);
}

typedef struct {
  uint8_t palette, start, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

static void amx_rate(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    printf("{\"op\": \"tdpbf16ps\", \"skipped\": \"arch_prctl refused the tile data permission\"}\n");
    return;
  }
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
  _tile_loadconfig(&c);
  static uint16_t a[1024], b[1024];
  static float out[256];
  for (int i = 0; i < 1024; i++) a[i] = b[i] = 0x3f80;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, a, 64); _tile_loadd(5, a + 512, 64); _tile_loadd(6, b, 64); _tile_loadd(7, b + 512, 64);
  const long iters = kIters / 2;
  double t = now();
  for (long n = 0; n < iters; n++) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  t = now() - t;
  _tile_stored(0, out, 64);
  _tile_release();
  printf("{\"op\": \"tdpbf16ps\", \"ginst_per_s\": %.3f, \"gmac_per_s\": %.1f, \"check\": %g}\n",
         iters * 4 / t / 1e9, iters * 4 * 16.0 * 16 * 32 / t / 1e9, out[0]);
}

int main(void) {
  unsigned a, b, c, d;
  __get_cpuid_count(7, 0, &a, &b, &c, &d);
  const int avx512f = (b >> 16) & 1, amx = ((d >> 22) & 1) && ((d >> 24) & 1);
  __get_cpuid_count(7, 1, &a, &b, &c, &d);
  const int bf16 = (a >> 5) & 1;
  if (avx512f) fma_rate();
  if (bf16) dpbf16_rate();
  if (amx) amx_rate();
  return 0;
}
