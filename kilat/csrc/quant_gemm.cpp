// Weight-quantized matmul for CPU: y[m, n] = sum_g scale[n, g] * (sum_{k in g} q[n, k] x[m, k])
//                                           + zero[n, g] * (sum_{k in g} x[m, k])
// over the packed layout of kilat/model_executor/layers/quantization/kernels.py: rows in blocks of 16, chunks of
// 16 rows x 4 columns (4 bits: 32 bytes, byte b = row b/4 in its low nibble and row 8 + b/4 in its high nibble,
// column b % 4; 8 bits: 64 bytes of q + 128, byte b = row b/4, column b % 4; 16 bits, a dense bfloat16 weight: 128
// bytes, two column pairs of 16 rows x 2 bfloat16, value v = 32 p + 2 r + j is column 2 p + j of row r, with one group,
// scale 1 and no zero), scales [Np/16, groups, 2, 16] (scale, zero) or [Np/16, groups, 1, 16] (zero 0) in float16 or
// float32. One output row per 32-bit lane of a 512-bit vector, so no horizontal sums.
//
// x of any dtype (float32, bfloat16, float16) is converted to float32 once per call (the row preparation, which
// also sums each group of x); q is widened to float32 and multiplied by x with FMAs, so the result is
// dequantize-then-matmul up to float32 rounding, written in x's dtype. CPUs with AVX2 and FMA but no AVX-512 run the
// same loops on 256-bit vectors (two per row block); others use the portable loops (same arithmetic). 16-bit x on
// CPUs with AVX512-VNNI or AVX2 takes an integer path instead (x as exact-or-nearly 16-bit integers per block, exact
// int32 dot products: gemm_block_vnni with vpdpbusd; on AVX2 gemm_block_int with vpmaddubsw for 4-bit weights (DotU8)
// and vpmaddwd for 8-bit ones (DotI16); all give the same integers, so the same outputs). On AVX2 from kTileRows rows
// of x, any dtype, the tile path instead (gemm_block_tile_avx2: weights dequantized once per row block, then FMAs;
// dequantize-then-matmul up to float32 rounding). 16-bit (dense bfloat16) weights on AVX2 take the float32 path below
// kTileRows rows and the tile path from there, widened exactly to float32 (a shift or a mask per column pair), so
// F.linear in float32 of the bfloat16 values up to float32 rounding. Threads: at::parallel_for over row blocks, so
// torch's intra-op thread count. With AVX512-BF16, bfloat16 x from 8 rows (4-bit weights) or 16 (8-bit) takes the
// bfloat16 dot-product path instead (run_gemm_bf16dp: q unpacked once per 32 weight rows into exact bfloat16,
// vdpbf16ps, float32 sums per group; dequantize-then-matmul up to float32 rounding).
//
// Ops (namespace kilat_quant_<isa>): gemm(x [..., K] float32|bfloat16|float16, qweight, scales, bits, group_size, N, K,
// bias?) -> [..., N] in x's dtype; dequantize(qweight, scales, bits, group_size, N, K, dtype) -> [N, K];
// embedding(ids int64 [...], qweight, scales, bits, group_size, N, K, dtype) -> [..., K] (rows w[ids]);
// has_avx512() / has_vnni() / has_bf16dp() / has_avx2() -> whether those paths were compiled in; has_dense16() ->
// whether 16-bit (dense bfloat16) weights run here (the AVX512-BF16 and AVX2 builds).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kilat_library.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#define KILAT_AVX512 1
#include <immintrin.h>
#if defined(__AVX512VNNI__)
#define KILAT_VNNI 1  // the integer path for 16-bit x (split_block, gemm_block_vnni)
#endif
#if defined(__AVX512BF16__)
#define KILAT_BF16DP 1  // bfloat16 x from a few rows: bfloat16 dot products (run_gemm_bf16dp)
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KILAT_AVX2 1  // 256-bit paths: float32 FMAs, and the integer path for 16-bit x (gemm_block_int)
#include <immintrin.h>
#endif
#if defined(KILAT_VNNI) || defined(KILAT_AVX2)
#define KILAT_INT_PATH 1  // 16-bit x takes an integer path
#endif

namespace {

constexpr int64_t kRows = 16;
constexpr int64_t kCols = 4;  // columns per chunk
// Software prefetch distance of the weight stream: ~2 KB ahead covers DRAM latency at this loop's speed (decode reads
// the weights from DRAM; 512 B ahead reached 15 GB/s, 2 KB 18.4 GB/s with 2 threads on the 2-core machine).
constexpr int64_t kPrefetchBytes = 2048;

inline float half_or_float(c10::Half h) { return static_cast<float>(h); }
inline float half_or_float(float f) { return f; }

struct Layout {
  int64_t bits, chunk_bytes, chunks, groups, span, n, k, blocks;
  int64_t planes;  // 2: scale and zero per group; 1: scale only (zero 0)
};

Layout layout_of(const at::Tensor& qweight, const at::Tensor& scales, int64_t bits, int64_t group_size, int64_t n,
                 int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 16, "bits must be 4, 8 or 16");
  Layout l;
  l.bits = bits;
  l.chunk_bytes = bits == 4 ? 32 : bits == 8 ? 64 : 128;
  TORCH_CHECK(qweight.dtype() == at::kByte && qweight.dim() == 3 && qweight.size(2) == l.chunk_bytes &&
                  qweight.is_contiguous(), "qweight must be contiguous uint8 [Np/16, Kp/4, 32, 64 or 128]");
  TORCH_CHECK((scales.dtype() == at::kHalf || scales.dtype() == at::kFloat) && scales.dim() == 4 &&
                  scales.size(0) == qweight.size(0) && (scales.size(2) == 1 || scales.size(2) == 2) &&
                  scales.size(3) == kRows && scales.is_contiguous(),
              "scales must be contiguous float16/float32 [Np/16, groups, 1 or 2, 16]");
  l.chunks = qweight.size(1);
  l.groups = scales.size(1);
  l.planes = scales.size(2);
  l.span = l.groups == 1 ? l.chunks * kCols : group_size;
  l.n = n;
  l.k = k;
  l.blocks = qweight.size(0);
  TORCH_CHECK(l.span * l.groups == l.chunks * kCols && l.span % 16 == 0, "group size does not fit qweight");
  TORCH_CHECK(bits != 16 || (l.groups == 1 && l.planes == 1), "16-bit weights have one group and no zero plane");
  TORCH_CHECK(n <= l.blocks * kRows && k <= l.chunks * kCols, "N/K do not fit qweight");
  return l;
}

// The bfloat16 weight of row r (0..15), column c of a 16-bit row block `bq` (chunks of two column pairs, each pair
// 16 rows x 2 columns).
inline float dense_at(const uint8_t* bq, int r, int64_t c) {
  const uint8_t* chunk = bq + (c / kCols) * 128;
  uint16_t v;
  std::memcpy(&v, chunk + (((c % kCols) / 2) * 32 + 2 * r + c % 2) * 2, sizeof(v));
  return static_cast<float>(c10::BFloat16(v, c10::BFloat16::from_bits()));
}

// q of row r (0..15), column c of row block `bq` (that block's bytes); 4- and 8-bit weights.
inline int q_at(const uint8_t* bq, const Layout& l, int r, int64_t c) {
  const uint8_t* chunk = bq + (c / kCols) * l.chunk_bytes;
  const int j = static_cast<int>(c % kCols);
  if (l.bits == 8) return static_cast<int>(chunk[4 * r + j]) - 128;
  const uint8_t b = chunk[4 * (r % 8) + j];
  return r < 8 ? (b & 0x0F) : (b >> 4);
}

template <typename S>
inline float scale_at(const S* sz, const Layout& l, int64_t blk, int64_t g, int which, int r) {
  if (which >= l.planes) return 0.f;
  return half_or_float(sz[((blk * l.groups + g) * l.planes + which) * kRows + r]);
}

// Activations prepared once per call: xf float32 [M, Kp] (x converted, zero padded); xsum [M, groups] sums of xf
// per group. With `split` (16-bit x on a CPU with an integer path) instead of xf: each block of `xblock` columns of a
// row as v = x / xscale, xscale a power of two with |v| <= 32639, v rounded to an integer (exact for bfloat16 values
// within 2^6 of the block's largest; the error is at most 1/32639 of that largest); with AVX512-VNNI split as
// v = 256 h + l, h and l int8, four columns per int32 word: xh, xl [M, Kp / 4]; with AVX2 the same xh, xl for 4-bit
// weights and int16 xv [M, Kp] for 8-bit ones; xscale [M, Kp / xblock]; with AVX512-VNNI vsum [M, Kp / xblock] the
// sums of v (the 8-bit weights' offset of 128).
struct Activations {
  int64_t m, kp, xblock = 0;
  bool split = false;
  std::vector<float> xf, xsum, xscale;
  std::vector<int32_t> xh, xl, vsum;
  std::vector<int16_t> xv;
};

// The exponent e of a block whose largest |x| is `big` (finite): the smallest with big * 2^-e <= 32639, at least -126
// (a block below ~2^-111 keeps fewer bits instead of vanishing). One place for both integer paths' scale.
inline int block_exponent(float big) {
  int e = 0;
  std::frexp(big, &e);  // big < 2^e
  e = std::max(e - 15, -126);
  if (big * std::ldexp(1.f, -e) > 32639.f) ++e;
  return e;
}

// v = x * 2^-e of one block of n (16 or 32) values as h and l bytes (see Activations); returns 2^e, or NaN when the
// block holds an Inf or NaN (the output is then NaN, as in the float32 path). v rounds to nearest even, like
// std::nearbyint.
#ifdef KILAT_VNNI
inline float split_block(const float* x, int64_t n, int8_t* h, int8_t* l, int32_t* vsum) {
  float big = 0.f;
  bool finite = true;
  for (int64_t c = 0; c < n; c += 16) {
    const __m512 v = _mm512_loadu_ps(x + c);
    finite = finite && _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) == 0;  // no NaN (max would drop it)
    big = std::max(big, _mm512_reduce_max_ps(_mm512_abs_ps(v)));
  }
  if (!finite || !std::isfinite(big)) {
    std::fill(h, h + n, 0);
    std::fill(l, l + n, 0);
    *vsum = 0;
    return std::numeric_limits<float>::quiet_NaN();
  }
  const int e = block_exponent(big);
  const float inv = std::ldexp(1.f, -e);
  int32_t sum = 0;  // |sum| <= 32 * 32639
  for (int64_t c = 0; c < n; c += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + c), _mm512_set1_ps(inv)));
    const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(128)), 8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + c), _mm512_cvtepi32_epi8(hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(l + c), _mm512_cvtepi32_epi8(_mm512_sub_epi32(v, _mm512_slli_epi32(hi, 8))));
    sum += _mm512_reduce_add_epi32(v);
  }
  *vsum = sum;
  return std::ldexp(1.f, e);
}
#endif

#ifdef KILAT_AVX2
// split_block's v as int16 (no h/l split): the same scale, the same rounding (nearest even), so the same integers.
// No sum of v: the AVX2 path multiplies signed 8-bit q directly, without split_block's offset of 128.
inline float v16_block(const float* x, int64_t n, int16_t* v16) {
  float big = 0.f;
  bool finite = true;
  for (int64_t c = 0; c < n; ++c) {
    finite = finite && !std::isnan(x[c]);
    big = std::max(big, std::fabs(x[c]));
  }
  if (!finite || !std::isfinite(big)) {
    std::fill(v16, v16 + n, 0);
    return std::numeric_limits<float>::quiet_NaN();
  }
  const int e = block_exponent(big);
  const float inv = std::ldexp(1.f, -e);
  for (int64_t c = 0; c < n; ++c) v16[c] = static_cast<int16_t>(std::nearbyint(x[c] * inv));
  return std::ldexp(1.f, e);
}

// v as split_block's bytes, v = 256 h + l with h = (v + 128) >> 8 in [-127, 127] and l in [-128, 127] (for
// DotU8, whose vpmaddubsw multiplies bytes).
inline void split_v16(const int16_t* v, int64_t n, int8_t* h, int8_t* l) {
  for (int64_t c = 0; c < n; ++c) {
    const int32_t hi = (static_cast<int32_t>(v[c]) + 128) >> 8;
    h[c] = static_cast<int8_t>(hi);
    l[c] = static_cast<int8_t>(v[c] - 256 * hi);
  }
}
#endif

Activations prepare(const at::Tensor& x, const Layout& l, bool split) {
  Activations a;
  a.m = x.size(0);
  a.kp = l.chunks * kCols;
  a.split = split;
  a.xf.assign(a.m * a.kp, 0.f);
  a.xsum.assign(a.m * l.groups, 0.f);
  if (split) {
    a.xblock = l.span % 32 == 0 ? 32 : 16;
    a.xscale.assign(a.m * a.kp / a.xblock, 0.f);
#ifdef KILAT_VNNI
    a.xh.assign(a.m * a.kp / 4, 0);
    a.xl.assign(a.m * a.kp / 4, 0);
    a.vsum.assign(a.m * a.kp / a.xblock, 0);
#else
    if (l.bits == 4) {
      a.xh.assign(a.m * a.kp / 4, 0);
      a.xl.assign(a.m * a.kp / 4, 0);
    } else {
      a.xv.assign(a.m * a.kp, 0);
    }
#endif
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "prepare", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    at::parallel_for(0, a.m, 4, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        float* xm = &a.xf[m * a.kp];
        for (int64_t c = 0; c < l.k; ++c) xm[c] = static_cast<float>(src[m * l.k + c]);
        for (int64_t g = 0; g < l.groups; ++g) {
          float sum = 0.f;
          for (int64_t c = g * l.span; c < (g + 1) * l.span; ++c) sum += xm[c];
          a.xsum[m * l.groups + g] = sum;
        }
        if (!split) continue;
        const int64_t blocks = a.kp / a.xblock;
#if defined(KILAT_VNNI)
        auto* h = reinterpret_cast<int8_t*>(&a.xh[m * a.kp / 4]);
        auto* lo = reinterpret_cast<int8_t*>(&a.xl[m * a.kp / 4]);
        for (int64_t b = 0; b < blocks; ++b)
          a.xscale[m * blocks + b] = split_block(xm + b * a.xblock, a.xblock, h + b * a.xblock, lo + b * a.xblock,
                                                 &a.vsum[m * blocks + b]);
#elif defined(KILAT_AVX2)
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t at = m * a.kp + b * a.xblock;
          if (l.bits == 8) {
            a.xscale[m * blocks + b] = v16_block(xm + b * a.xblock, a.xblock, &a.xv[at]);
            continue;
          }
          int16_t v[32];  // 4-bit weights take v only as its h, l bytes
          a.xscale[m * blocks + b] = v16_block(xm + b * a.xblock, a.xblock, v);
          split_v16(v, a.xblock, reinterpret_cast<int8_t*>(a.xh.data()) + at, reinterpret_cast<int8_t*>(a.xl.data()) + at);
        }
#endif
      }
    });
  });
  if (split) std::vector<float>().swap(a.xf);
  return a;
}

// ---------------------------------------------------------------------------------------------- portable path
template <typename S>
void gemm_block_ref(const Activations& a, const uint8_t* qw, const S* sz, const Layout& l, int64_t blk,
                    float* y /* [M, 16] */) {
  const uint8_t* bq = qw + blk * l.chunks * l.chunk_bytes;
  for (int r = 0; r < kRows; ++r)
    for (int64_t m = 0; m < a.m; ++m) {
      const float* xm = &a.xf[m * a.kp];
      float acc = 0.f;
      for (int64_t g = 0; g < l.groups; ++g) {
        float dot = 0.f;
        for (int64_t c = g * l.span; c < (g + 1) * l.span; ++c) dot += static_cast<float>(q_at(bq, l, r, c)) * xm[c];
        acc += scale_at(sz, l, blk, g, 0, r) * dot + scale_at(sz, l, blk, g, 1, r) * a.xsum[m * l.groups + g];
      }
      y[m * kRows + r] = acc;
    }
}

#ifdef KILAT_AVX512
// ------------------------------------------------------------------------------------------------ AVX-512 path
template <typename S>
inline __m512 load16(const S* s) {
  if constexpr (sizeof(S) == 2)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  else
    return _mm512_loadu_ps(reinterpret_cast<const float*>(s));
}

// Scale and zero vectors of group g of row block blk.
template <typename S>
inline void load_scales(const S* sz, const Layout& l, int64_t blk, int64_t g, __m512& sv, __m512& zv) {
  const S* s = sz + (blk * l.groups + g) * l.planes * kRows;
  sv = load16(s);
  zv = l.planes == 2 ? load16(s + kRows) : _mm512_setzero_ps();
}

// One chunk as 16 lanes (rows) of 4 bytes (columns): q for 4 bits, q + 128 for 8 bits.
template <int BITS>
inline __m512i load_chunk(const uint8_t* wp) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_loadu_si512(wp);
  }
}

// Rows m0 .. m0 + MT of x (float32) times row block blk: q widened to float32, FMAs with broadcast x. A partial sums
// per row (column j of a chunk into sum j % A), so that at least 4 independent FMA chains hide the FMA latency.
template <int BITS, int MT, typename S>
void gemm_block_fp32(const Activations& a, int64_t m0, const uint8_t* qw, const S* sz, const Layout& l, int64_t blk,
                     float* y) {
  constexpr int A = MT >= kCols ? 1 : kCols / MT;
  const uint8_t* wp = qw + blk * l.chunks * l.chunk_bytes;
  const int64_t chunks_per_group = l.span / kCols;
  const __m512 kNibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < l.groups; ++g) {
    __m512 sv, zv;
    load_scales(sz, l, blk, g, sv, zv);
    __m512 dot[MT][A];
    for (int i = 0; i < MT; ++i)
      for (int s = 0; s < A; ++s) dot[i][s] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks_per_group; ++c, wp += l.chunk_bytes) {
      _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
      __m512i w = load_chunk<BITS>(wp);
      if constexpr (BITS == 8) w = _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));  // q as int8
      const int64_t col = g * l.span + c * kCols;
      for (int j = 0; j < kCols; ++j) {
        __m512 wf;
        if constexpr (BITS == 8)
          wf = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * j), 24));
        else  // q (0..15) looked up as a float: vpermps reads the low 4 bits of each lane, byte j's nibble
          wf = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 8 * j), kNibbles);
        for (int i = 0; i < MT; ++i)
          dot[i][j % A] = _mm512_fmadd_ps(wf, _mm512_set1_ps(a.xf[(m0 + i) * a.kp + col + j]), dot[i][j % A]);
      }
    }
    for (int i = 0; i < MT; ++i) {
      for (int s = 1; s < A; ++s) dot[i][0] = _mm512_add_ps(dot[i][0], dot[i][s]);
      acc[i] = _mm512_fmadd_ps(dot[i][0], sv, acc[i]);
      acc[i] = _mm512_fmadd_ps(zv, _mm512_set1_ps(a.xsum[(m0 + i) * l.groups + g]), acc[i]);
    }
  }
  for (int i = 0; i < MT; ++i) _mm512_storeu_ps(y + (m0 + i) * kRows, acc[i]);
}

template <int BITS, typename S>
void gemm_block_avx512(const Activations& a, const uint8_t* qw, const S* sz, const Layout& l, int64_t blk, float* y) {
  int64_t m0 = 0;
  for (; m0 + 8 <= a.m; m0 += 8) gemm_block_fp32<BITS, 8, S>(a, m0, qw, sz, l, blk, y);
  if (m0 + 4 <= a.m) {
    gemm_block_fp32<BITS, 4, S>(a, m0, qw, sz, l, blk, y);
    m0 += 4;
  }
  if (m0 + 2 <= a.m) {
    gemm_block_fp32<BITS, 2, S>(a, m0, qw, sz, l, blk, y);
    m0 += 2;
  }
  if (m0 < a.m) gemm_block_fp32<BITS, 1, S>(a, m0, qw, sz, l, blk, y);
}
#endif

#ifdef KILAT_VNNI
// 16-bit x (bfloat16/float16) with integer dot products: per block of columns, sum_k u[n, k] v[m, k] exactly in
// int32 with vpdpbusd (u = q for 4 bits, q + 128 for 8 bits, unsigned; v = 256 h + l from prepare, signed), then
// converted to float32 and scaled by the block's xscale and the weight's group scale. Only v's rounding (at most
// 1/32639 of its block's largest |x|) separates it from the float32 path; the result is rounded to 16 bits anyway.
// One chunk costs ~5 vector instructions instead of ~14 for q -> float32 and 4 FMAs.
template <int BITS, int MT, typename S>
void gemm_block_vnni(const Activations& a, int64_t m0, const uint8_t* qw, const S* sz, const Layout& l, int64_t blk,
                     float* y) {
  constexpr int U = MT == 1 ? 2 : 1;  // independent accumulators per row (hide vpdpbusd's latency at one row)
  const uint8_t* wp = qw + blk * l.chunks * l.chunk_bytes;
  const int64_t chunks_per_block = a.xblock / kCols, blocks_per_group = l.span / a.xblock;
  const int64_t xblocks = a.kp / a.xblock;
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  int64_t chunk = 0;
  for (int64_t g = 0; g < l.groups; ++g) {
    __m512 sv, zv;
    load_scales(sz, l, blk, g, sv, zv);
    for (int64_t b = 0; b < blocks_per_group; ++b) {
      const int64_t xb = g * blocks_per_group + b;
      __m512i ih[MT][U], il[MT][U];
      for (int i = 0; i < MT; ++i)
        for (int u = 0; u < U; ++u) ih[i][u] = il[i][u] = _mm512_setzero_si512();
      for (int64_t c = 0; c < chunks_per_block; c += U) {  // u unrolled, so the accumulators stay in registers
#pragma GCC unroll 2
        for (int u = 0; u < U; ++u, ++chunk, wp += l.chunk_bytes) {
          _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
          const __m512i w = load_chunk<BITS>(wp);
#pragma GCC unroll 8
          for (int i = 0; i < MT; ++i) {
            const int64_t at = (m0 + i) * (a.kp / 4) + chunk;
            ih[i][u] = _mm512_dpbusd_epi32(ih[i][u], w, _mm512_set1_epi32(a.xh[at]));
            il[i][u] = _mm512_dpbusd_epi32(il[i][u], w, _mm512_set1_epi32(a.xl[at]));
          }
        }
      }
      for (int i = 0; i < MT; ++i) {
        for (int u = 1; u < U; ++u) {
          ih[i][0] = _mm512_add_epi32(ih[i][0], ih[i][u]);
          il[i][0] = _mm512_add_epi32(il[i][0], il[i][u]);
        }
        __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(ih[i][0], 8), il[i][0]);
        if constexpr (BITS == 8)
          dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * a.vsum[(m0 + i) * xblocks + xb]));
        const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(a.xscale[(m0 + i) * xblocks + xb]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
      }
    }
    for (int i = 0; i < MT; ++i)
      acc[i] = _mm512_fmadd_ps(zv, _mm512_set1_ps(a.xsum[(m0 + i) * l.groups + g]), acc[i]);
  }
  for (int i = 0; i < MT; ++i) _mm512_storeu_ps(y + (m0 + i) * kRows, acc[i]);
}

template <int BITS, typename S>
void gemm_block_split(const Activations& a, const uint8_t* qw, const S* sz, const Layout& l, int64_t blk, float* y) {
  // 5 or 6 rows (a verification pass of 1 + k tokens) in one pass over the weights: 15-20% faster than 4 + 1 or
  // 4 + 2 on Zen 4 (docs/benchmarks.md); else 4 rows per pass (8 rows measured slower: register pressure), the
  // remaining 1-3 in one more.
  if (a.m == 5) return gemm_block_vnni<BITS, 5, S>(a, 0, qw, sz, l, blk, y);
  if (a.m == 6) return gemm_block_vnni<BITS, 6, S>(a, 0, qw, sz, l, blk, y);
  int64_t m0 = 0;
  for (; m0 + 4 <= a.m; m0 += 4) gemm_block_vnni<BITS, 4, S>(a, m0, qw, sz, l, blk, y);
  if (a.m - m0 == 3) gemm_block_vnni<BITS, 3, S>(a, m0, qw, sz, l, blk, y);
  if (a.m - m0 == 2) gemm_block_vnni<BITS, 2, S>(a, m0, qw, sz, l, blk, y);
  if (a.m - m0 == 1) gemm_block_vnni<BITS, 1, S>(a, m0, qw, sz, l, blk, y);
}
#endif

#ifdef KILAT_AVX2
// ---------------------------------------------------------------------------------------------------- AVX2 paths
// A row block as two 256-bit halves, h = 0 for rows 0-7 and h = 1 for rows 8-15, one row per 32-bit lane.
template <typename S>
inline __m256 load8(const S* s) {
  if constexpr (sizeof(S) == 2)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  else
    return _mm256_loadu_ps(reinterpret_cast<const float*>(s));
}

template <typename S>
inline void load_scales8(const S* sz, const Layout& l, int64_t blk, int64_t g, __m256 sv[2], __m256 zv[2]) {
  const S* s = sz + (blk * l.groups + g) * l.planes * kRows;
  for (int h = 0; h < 2; ++h) {
    sv[h] = load8(s + 8 * h);
    zv[h] = l.planes == 2 ? load8(s + kRows + 8 * h) : _mm256_setzero_ps();
  }
}

// A chunk's halves, 4 bytes (columns) per lane: q for 4 bits, q as int8 for 8 bits.
template <int BITS>
inline void load_halves(const uint8_t* wp, __m256i w[2]) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    w[0] = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    w[0] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)), flip);
    w[1] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32)), flip);
  }
}

// Column j of a half as float32.
template <int BITS>
inline __m256 column(__m256i w, int j) {
  if constexpr (BITS == 4)
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 8 * j), _mm256_set1_epi32(0xFF)));
  else
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * j), 24));
}

// Columns 2 p + j (j = 0, 1) of one half of a 16-bit chunk's pair p, `v` = that half's 8 lanes (rows) of two
// bfloat16: the low or the high 16 bits as float32, exactly.
inline __m256 bf16_column(__m256i v, int j) {
  return _mm256_castsi256_ps(j == 0 ? _mm256_slli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(-65536)));
}

// The four columns of the chunk at wp as float32, wf[j][h] = column j of half h: q for 4 and 8 bits, the weights
// themselves for 16 (each column pair's halves widened by bf16_column).
template <int BITS>
inline void chunk_columns(const uint8_t* wp, __m256 wf[kCols][2]) {
  if constexpr (BITS == 16) {
    for (int p = 0; p < 2; ++p)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 64 * p + 32 * h));
        wf[2 * p][h] = bf16_column(v, 0);
        wf[2 * p + 1][h] = bf16_column(v, 1);
      }
  } else {
    __m256i w[2];
    load_halves<BITS>(wp, w);
    for (int j = 0; j < kCols; ++j)
      for (int h = 0; h < 2; ++h) wf[j][h] = column<BITS>(w[h], j);
  }
}

// gemm_block_fp32 on two halves: the same partial sums and operations per row, so the same results. 16-bit weights
// have one group of scale 1 and zero 0.
template <int BITS, int MT, typename S>
void gemm_block_fp32_avx2(const Activations& a, int64_t m0, const uint8_t* qw, const S* sz, const Layout& l,
                          int64_t blk, float* y) {
  constexpr int A = MT >= kCols ? 1 : kCols / MT;
  const uint8_t* wp = qw + blk * l.chunks * l.chunk_bytes;
  const int64_t chunks_per_group = l.span / kCols;
  __m256 acc[MT][2];
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < l.groups; ++g) {
    __m256 sv[2], zv[2];
    load_scales8(sz, l, blk, g, sv, zv);
    __m256 dot[MT][A][2];
    for (int i = 0; i < MT; ++i)
      for (int s = 0; s < A; ++s) dot[i][s][0] = dot[i][s][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks_per_group; ++c, wp += l.chunk_bytes) {
      _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
      if constexpr (BITS == 16) _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes + 64, _MM_HINT_T0);
      const int64_t col = g * l.span + c * kCols;
      __m256 wf[kCols][2];
      chunk_columns<BITS>(wp, wf);
      for (int j = 0; j < kCols; ++j)
        for (int h = 0; h < 2; ++h)
          for (int i = 0; i < MT; ++i)
            dot[i][j % A][h] =
                _mm256_fmadd_ps(wf[j][h], _mm256_set1_ps(a.xf[(m0 + i) * a.kp + col + j]), dot[i][j % A][h]);
    }
    for (int i = 0; i < MT; ++i)
      for (int h = 0; h < 2; ++h) {
        for (int s = 1; s < A; ++s) dot[i][0][h] = _mm256_add_ps(dot[i][0][h], dot[i][s][h]);
        acc[i][h] = _mm256_fmadd_ps(dot[i][0][h], sv[h], acc[i][h]);
        acc[i][h] = _mm256_fmadd_ps(zv[h], _mm256_set1_ps(a.xsum[(m0 + i) * l.groups + g]), acc[i][h]);
      }
  }
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + i) * kRows + 8 * h, acc[i][h]);
}

template <int BITS, typename S>
void gemm_block_avx2(const Activations& a, const uint8_t* qw, const S* sz, const Layout& l, int64_t blk, float* y) {
  int64_t m0 = 0;  // 2 rows per pass: AVX2 has 16 vector registers
  for (; m0 + 2 <= a.m; m0 += 2) gemm_block_fp32_avx2<BITS, 2, S>(a, m0, qw, sz, l, blk, y);
  if (m0 < a.m) gemm_block_fp32_avx2<BITS, 1, S>(a, m0, qw, sz, l, blk, y);
}

// The integer paths' dot products of one block of x's columns (xblock / 4 chunks), as exact int32 sums
// sum_k q[n, k] v[m, k] for rows 0-7 and 8-15 of a row block. Two kinds, one per weight width:
//
// DotI16 (8-bit weights): q as int16 (four vectors per chunk, q[i] = rows 4i .. 4i+3 x 4 columns) times x's int16 v
// with vpmaddwd (|q| <= 128, |v| <= 32639: a block of 32 columns sums to less than 2^27).
struct DotI16 {
  struct Acc {
    __m256i p[4];
  };
  using Weights = std::array<__m256i, 4>;
  static Weights load(const uint8_t* wp) {
    const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
    Weights q;
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi8_epi16(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16 * i)), flip));
    return q;
  }
  static void zero(Acc& acc) {
    for (__m256i& p : acc.p) p = _mm256_setzero_si256();
  }
  static void add(Acc& acc, const Weights& q, const Activations& a, int64_t m, int64_t chunk) {
    int64_t four;  // v of the chunk's 4 columns, broadcast
    std::memcpy(&four, &a.xv[m * a.kp + chunk * kCols], sizeof(four));
    const __m256i v = _mm256_set1_epi64x(four);
    for (int r = 0; r < 4; ++r) acc.p[r] = _mm256_add_epi32(acc.p[r], _mm256_madd_epi16(q[r], v));
  }
  // p[i] = [row 4i: columns 0+1, 2+3, row 4i+1: ..., row 4i+3: ...]: hadd pairs them as rows 0 1 4 5 | 2 3 6 7, the
  // 64-bit permute restores the order.
  static void finish(const Acc& acc, __m256i dot[2]) {
    dot[0] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc.p[0], acc.p[1]), _MM_SHUFFLE(3, 1, 2, 0));
    dot[1] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc.p[2], acc.p[3]), _MM_SHUFFLE(3, 1, 2, 0));
  }
};

// DotU8 (4-bit weights): q (0..15, unsigned bytes; low nibbles rows 0-7, high nibbles rows 8-15) times x's h and l
// bytes (v = 256 h + l) with vpmaddubsw, pairs of columns summed in int16 and a block's chunks accumulated in int16
// (|pair| <= 2 * 15 * 128 = 3840, at most 8 chunks <= 30720: no saturation), widened once per block with vpmaddwd
// by ones: 256 sum(q h) + sum(q l) = sum(q v), the integers DotI16 would give, with ~1/3 fewer instructions.
struct DotU8 {
  struct Acc {
    __m256i h[2], l[2];
  };
  using Weights = std::array<__m256i, 2>;
  static Weights load(const uint8_t* wp) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    return {_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask)};
  }
  static void zero(Acc& acc) {
    for (int half = 0; half < 2; ++half) acc.h[half] = acc.l[half] = _mm256_setzero_si256();
  }
  static void add(Acc& acc, const Weights& w, const Activations& a, int64_t m, int64_t chunk) {
    const int64_t at = m * (a.kp / 4) + chunk;
    const __m256i xh = _mm256_set1_epi32(a.xh[at]), xl = _mm256_set1_epi32(a.xl[at]);
    for (int half = 0; half < 2; ++half) {
      acc.h[half] = _mm256_add_epi16(acc.h[half], _mm256_maddubs_epi16(w[half], xh));
      acc.l[half] = _mm256_add_epi16(acc.l[half], _mm256_maddubs_epi16(w[half], xl));
    }
  }
  static void finish(const Acc& acc, __m256i dot[2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; ++half)
      dot[half] = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(acc.h[half], ones), 8),
                                   _mm256_madd_epi16(acc.l[half], ones));
  }
};

// 16-bit x on AVX2: per block of columns the exact int32 dot of `Dot`, then as gemm_block_vnni: converted to float32,
// scaled by the block's xscale and the group scale, the zero term added per group. The same integers and float
// operations as gemm_block_vnni, so the same outputs.
template <typename Dot, int MT, typename S>
void gemm_block_int(const Activations& a, int64_t m0, const uint8_t* qw, const S* sz, const Layout& l, int64_t blk,
                    float* y) {
  const uint8_t* wp = qw + blk * l.chunks * l.chunk_bytes;
  const int64_t chunks_per_block = a.xblock / kCols, blocks_per_group = l.span / a.xblock;
  const int64_t xblocks = a.kp / a.xblock;
  __m256 acc[MT][2];
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  int64_t chunk = 0;
  for (int64_t g = 0; g < l.groups; ++g) {
    __m256 sv[2], zv[2];
    load_scales8(sz, l, blk, g, sv, zv);
    for (int64_t b = 0; b < blocks_per_group; ++b) {
      const int64_t xb = g * blocks_per_group + b;
      typename Dot::Acc p[MT];
      for (int i = 0; i < MT; ++i) Dot::zero(p[i]);
      for (int64_t c = 0; c < chunks_per_block; ++c, ++chunk, wp += l.chunk_bytes) {
        _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
        const typename Dot::Weights w = Dot::load(wp);
        for (int i = 0; i < MT; ++i) Dot::add(p[i], w, a, m0 + i, chunk);
      }
      for (int i = 0; i < MT; ++i) {
        __m256i dot[2];
        Dot::finish(p[i], dot);
        const __m256 xs = _mm256_set1_ps(a.xscale[(m0 + i) * xblocks + xb]);
        for (int h = 0; h < 2; ++h)
          acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), _mm256_mul_ps(sv[h], xs), acc[i][h]);
      }
    }
    for (int i = 0; i < MT; ++i)
      for (int h = 0; h < 2; ++h)
        acc[i][h] = _mm256_fmadd_ps(zv[h], _mm256_set1_ps(a.xsum[(m0 + i) * l.groups + g]), acc[i][h]);
  }
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + i) * kRows + 8 * h, acc[i][h]);
}

template <int BITS, typename S>
void gemm_block_int_avx2(const Activations& a, const uint8_t* qw, const S* sz, const Layout& l, int64_t blk,
                         float* y) {
  using Dot = std::conditional_t<BITS == 4, DotU8, DotI16>;
  int64_t m0 = 0;
  for (; m0 + 2 <= a.m; m0 += 2) gemm_block_int<Dot, 2, S>(a, m0, qw, sz, l, blk, y);
  if (m0 < a.m) gemm_block_int<Dot, 1, S>(a, m0, qw, sz, l, blk, y);
}
#endif

// Columns c0 .. c0 + 15 of row block blk dequantized: tile[j][r] = w[blk * 16 + r, c0 + j] = q * s + z, rounded twice
// as torch computes it (no FMA), so exactly dequantize()'s values (16 columns never straddle a group: span % 16 == 0);
// for 16-bit weights the bfloat16 values widened to float32.
template <typename S>
void dequantize_tile(const uint8_t* qw, const S* sz, const Layout& l, int64_t blk, int64_t c0, float tile[16][kRows]) {
  const uint8_t* bq = qw + blk * l.chunks * l.chunk_bytes;
  const int64_t g = c0 / l.span;
#ifndef KILAT_AVX2
  if (l.bits == 16) {
    for (int j = 0; j < 16; ++j)
      for (int r = 0; r < kRows; ++r) tile[j][r] = dense_at(bq, r, c0 + j);
    return;
  }
#endif
#ifdef KILAT_AVX512
  __m512 sv, zv;
  load_scales(sz, l, blk, g, sv, zv);
  for (int64_t ch = 0; ch < 4; ++ch) {
    const uint8_t* wp = bq + (c0 / kCols + ch) * l.chunk_bytes;
    __m512i w = l.bits == 4 ? load_chunk<4>(wp) : _mm512_xor_si512(load_chunk<8>(wp), _mm512_set1_epi8(static_cast<char>(0x80)));
    for (int j = 0; j < kCols; ++j) {
      const __m512i qi = l.bits == 4 ? _mm512_and_si512(_mm512_srli_epi32(w, 8 * j), _mm512_set1_epi32(0xFF))
                                     : _mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * j), 24);
      // q * s + z rounded twice, as torch computes it (no FMA)
      _mm512_storeu_ps(tile[ch * kCols + j], _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(qi), sv), zv));
    }
  }
#elif defined(KILAT_AVX2)
  __m256 sv[2], zv[2];
  load_scales8(sz, l, blk, g, sv, zv);
  for (int64_t ch = 0; ch < 4; ++ch) {
    __m256 wf[kCols][2];
    const uint8_t* wp = bq + (c0 / kCols + ch) * l.chunk_bytes;
    if (l.bits == 16) chunk_columns<16>(wp, wf);  // the weights themselves: stored as they are
    else if (l.bits == 4) chunk_columns<4>(wp, wf);
    else chunk_columns<8>(wp, wf);
    for (int j = 0; j < kCols; ++j)
      for (int h = 0; h < 2; ++h)  // q * s + z rounded twice, as torch computes it (no FMA)
        _mm256_storeu_ps(tile[ch * kCols + j] + 8 * h,
                         l.bits == 16 ? wf[j][h] : _mm256_add_ps(_mm256_mul_ps(wf[j][h], sv[h]), zv[h]));
  }
#else
  for (int j = 0; j < 16; ++j)
    for (int r = 0; r < kRows; ++r)
      tile[j][r] = static_cast<float>(q_at(bq, l, r, c0 + j)) * scale_at(sz, l, blk, g, 0, r) +
                   scale_at(sz, l, blk, g, 1, r);
#endif
}

#ifdef KILAT_AVX2
// AVX2 from kTileRows rows of x on (batched decode, short prefill chunks): each row block's weights dequantized once
// into a float32 tile t [Kp, 16] (dequantize()'s values), then kTileMT rows of x at a time against it, two 8-row
// halves per row of x: 12 independent FMA chains, one broadcast of x per FMA pair. The widening of q (and the
// integer path's two byte products per weight) are paid once per row block instead of once per pair of rows of x:
// on the Zen 1 machine (2 vCPUs, 2 threads) the SmolLM2 shapes at 64 rows went from ~20 to 32-34 GMAC/s, and at
// 128-2,048 rows the tile beats dequantizing for a dense float32 matmul (~35 against ~30 GMAC/s).
constexpr int64_t kTileRows = 8;
constexpr int kTileMT = 6;

// Rows m0 .. m0 + MT of y [., 16] = x [., kp] (float32, row stride kp) times t [kp, 16]. The unroll pragmas matter:
// without them GCC also kept lo/hi on the stack and stored them after every FMA, at half the speed.
template <int MT>
__attribute__((noinline)) void tile_rows(const float* t, const float* x, int64_t kp, float* y) {
  __m256 lo[MT], hi[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < kp; ++c, t += kRows) {
    const __m256 w0 = _mm256_loadu_ps(t), w1 = _mm256_loadu_ps(t + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * kp + c);
      lo[i] = _mm256_fmadd_ps(w0, xv, lo[i]);
      hi[i] = _mm256_fmadd_ps(w1, xv, hi[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    _mm256_storeu_ps(y + i * kRows, lo[i]);
    _mm256_storeu_ps(y + i * kRows + 8, hi[i]);
  }
}

template <typename S>
void gemm_block_tile_avx2(const Activations& a, const uint8_t* qw, const S* sz, const Layout& l, int64_t blk,
                          std::vector<float>& t, float* y) {
  t.resize(a.kp * kRows);
  for (int64_t c0 = 0; c0 < a.kp; c0 += 16)
    dequantize_tile(qw, sz, l, blk, c0, reinterpret_cast<float(*)[kRows]>(t.data() + c0 * kRows));
  const float* x = a.xf.data();
  int64_t m0 = 0;
  for (; m0 + kTileMT <= a.m; m0 += kTileMT) tile_rows<kTileMT>(t.data(), x + m0 * a.kp, a.kp, y + m0 * kRows);
  const float* xm = x + m0 * a.kp;
  float* ym = y + m0 * kRows;
  switch (a.m - m0) {
    case 5: tile_rows<5>(t.data(), xm, a.kp, ym); break;
    case 4: tile_rows<4>(t.data(), xm, a.kp, ym); break;
    case 3: tile_rows<3>(t.data(), xm, a.kp, ym); break;
    case 2: tile_rows<2>(t.data(), xm, a.kp, ym); break;
    case 1: tile_rows<1>(t.data(), xm, a.kp, ym); break;
    default: break;
  }
}
#endif

#ifdef KILAT_BF16DP
// ------------------------------------------------------------------------------------- AVX512-BF16 path
// bfloat16 x from bf16dp_min_rows rows on (prefill, batched decode): the step is compute-bound there, so the weights are
// unpacked once per pair of row blocks into a tile of exact bfloat16 q (q is an integer of at most 8 significant
// bits, so q is exact in bfloat16, and each q x product is exact in float32) and multiplied with vdpbf16ps, 32
// multiply-adds per instruction, accumulated in float32 per group: y = sum_g scale_g * (sum_k q x) + zero_g * sum_k x,
// dequantize-then-matmul up to float32 rounding (as the float32 path; vdpbf16ps flushes float32 denormals, at most
// 2^-126 per sum). The unpacking (~5 vector instructions per 64 weights) is paid once per 32 weight rows and read by
// every row of x; kBfMT rows of x at a time against 32 weight rows: 12 independent accumulators. A dense bfloat16
// weight (16 bits) is read in place, its chunks already in the tile's order.
// From this many rows of bfloat16 x (measured on Zen 5, docs/benchmarks.md "Compute-bound steps"): 8-bit weights cost
// ~3x the unpacking of 4-bit ones, so they need more rows of x to pay for it; 16-bit ones (dense bfloat16, read in
// place) take this path at every size.
inline int64_t bf16dp_min_rows(int64_t bits) { return bits == 4 ? 8 : bits == 8 ? 16 : 1; }
// 6 rows x 2 row blocks measured best of 6x2, 4x3, 3x4, 5x2, 8x1 and 4x2 at 16 and 176 rows (SmolLM2 shapes, Zen 5).
constexpr int kBfMT = 6;
constexpr int kBfMTOne = 12;  // rows of x per pass for weights of one group (bf16dp_rows_one)
constexpr int kBfBlocks = 2;  // row blocks per tile
constexpr int kBfCols = kBfBlocks * kRows;

// The bfloat16 bit patterns of 0..31 (vpermw's table; exact: small integers).
inline __m512i small_int_bf16() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>(i);
    uint32_t b;
    std::memcpy(&b, &f, sizeof(b));
    t[i] = static_cast<uint16_t>(b >> 16);
  }
  return _mm512_load_si512(t);
}

// The upper halves of two float32 vectors' lanes interleaved: lane r = (bf16(lo[r]), bf16(hi[r])), exact for values
// whose low 16 bits are zero (small integers).
inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
  return _mm512_mask_mov_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16), 0xAAAAAAAA, _mm512_castps_si512(hi));
}

// Row block bq's q as bfloat16 pairs: tile[p * stride + 2 r + j] = q[r, 2 p + j] for pairs p < Kp / 2, rows r < 16
// (stride in bfloat16 values: 32 per row block of the tile).
template <int BITS>
void unpack_bf16(const uint8_t* bq, const Layout& l, uint16_t* tile, int64_t stride) {
  const __m512i table = small_int_bf16();
  // per dword d of a 128-bit lane: bytes 4d and 4d + 1 (columns 0, 1), or 4d + 2 and 4d + 3, zero-extended to words
  const __m512i cols01 = _mm512_set4_epi32(0x800D800C, 0x80098008, 0x80058004, 0x80018000);
  const __m512i cols23 = _mm512_set4_epi32(0x800F800E, 0x800B800A, 0x80078006, 0x80038002);
  for (int64_t c = 0; c < l.chunks; ++c, bq += l.chunk_bytes, tile += 2 * stride) {
    const __m512i w = load_chunk<BITS>(bq);
    __m512i p0, p1;
    if constexpr (BITS == 4) {
      p0 = _mm512_permutexvar_epi16(_mm512_shuffle_epi8(w, cols01), table);
      p1 = _mm512_permutexvar_epi16(_mm512_shuffle_epi8(w, cols23), table);
    } else {
      const __m512i qs = _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));  // q as int8
      __m512 f[4];
      for (int j = 0; j < 4; ++j) f[j] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(qs, 24 - 8 * j), 24));
      p0 = bf16_pairs(f[0], f[1]);
      p1 = bf16_pairs(f[2], f[3]);
    }
    _mm512_storeu_si512(tile, p0);
    _mm512_storeu_si512(tile + stride, p1);
  }
}

inline __m512bh pair_of(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(v));
}

// Rows 0 .. MT of x (bfloat16, row stride ldx) times NB row blocks of bfloat16 pairs: out[i * kBfCols + 16 nb + r]
// (float32). Pair p of block nb (16 rows x 2 columns) at blocks[nb] + p * pstride; sc: [groups, planes, NB * 16]
// float32 scales (and zeros); xsum: [MT, groups] row sums of x per group.
template <int MT, int NB>
void bf16dp_rows(const uint16_t* const* blocks, int64_t pstride, const float* sc, int64_t planes, const uint16_t* x,
                 int64_t ldx, const float* xsum, int64_t groups, int64_t pairs_per_group, float* out) {
  __m512 acc[MT][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
    for (int nb = 0; nb < NB; ++nb) acc[i][nb] = _mm512_setzero_ps();
  int64_t at = 0;  // offset of the current pair in each block
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dot[MT][NB];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
      for (int nb = 0; nb < NB; ++nb) dot[i][nb] = _mm512_setzero_ps();
    const uint16_t* xg = x + 2 * g * pairs_per_group;
    for (int64_t p = 0; p < pairs_per_group; ++p, at += pstride) {
      __m512bh b[NB];
      for (int nb = 0; nb < NB; ++nb) b[nb] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(blocks[nb] + at));
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const __m512bh xv = pair_of(xg + i * ldx + 2 * p);
        for (int nb = 0; nb < NB; ++nb) dot[i][nb] = _mm512_dpbf16_ps(dot[i][nb], xv, b[nb]);
      }
    }
    const float* s = sc + g * planes * NB * kRows;
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
      for (int nb = 0; nb < NB; ++nb) {
        acc[i][nb] = _mm512_fmadd_ps(dot[i][nb], _mm512_loadu_ps(s + nb * kRows), acc[i][nb]);
        if (planes == 2)
          acc[i][nb] = _mm512_fmadd_ps(_mm512_loadu_ps(s + (NB + nb) * kRows), _mm512_set1_ps(xsum[i * groups + g]),
                                       acc[i][nb]);
      }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
    for (int nb = 0; nb < NB; ++nb) _mm512_storeu_ps(out + i * kBfCols + nb * kRows, acc[i][nb]);
}

// bf16dp_rows for weights of one group (per-channel, and dense 16-bit ones): no per-group accumulator, so twice the
// rows of x per pass (24 accumulators; 12 x 2 measured ~10% faster than 6 x 2 at 256 rows of a dense weight).
template <int MT, int NB>
void bf16dp_rows_one(const uint16_t* const* blocks, int64_t pstride, bool in_place, const float* sc, int64_t planes,
                     const uint16_t* x, int64_t ldx, const float* xsum, int64_t pairs, float* out) {
  constexpr int U = MT <= 2 ? 2 : 1;  // independent accumulators per output (few rows: hide vdpbf16ps's latency)
  __m512 dot[U][MT][NB];
#pragma GCC unroll 12
  for (int i = 0; i < MT; ++i)
    for (int nb = 0; nb < NB; ++nb)
      for (int u = 0; u < U; ++u) dot[u][i][nb] = _mm512_setzero_ps();
  for (int64_t p = 0, at = 0; p < pairs; p += U) {  // pairs is even (Kp is a multiple of 32)
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u, at += pstride) {
      __m512bh b[NB];
      for (int nb = 0; nb < NB; ++nb) {
        // weights read in place stream from DRAM: prefetch ahead (into the next row block past a block's end)
        if (in_place) _mm_prefetch(reinterpret_cast<const char*>(blocks[nb] + at) + kPrefetchBytes, _MM_HINT_T0);
        b[nb] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(blocks[nb] + at));
      }
#pragma GCC unroll 12
      for (int i = 0; i < MT; ++i) {
        const __m512bh xv = pair_of(x + i * ldx + 2 * (p + u));
        for (int nb = 0; nb < NB; ++nb) dot[u][i][nb] = _mm512_dpbf16_ps(dot[u][i][nb], xv, b[nb]);
      }
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MT; ++i)
    for (int nb = 0; nb < NB; ++nb) {
      if constexpr (U == 2) dot[0][i][nb] = _mm512_add_ps(dot[0][i][nb], dot[1][i][nb]);
      __m512 y = _mm512_mul_ps(dot[0][i][nb], _mm512_loadu_ps(sc + nb * kRows));
      if (planes == 2) y = _mm512_fmadd_ps(_mm512_loadu_ps(sc + (NB + nb) * kRows), _mm512_set1_ps(xsum[i]), y);
      _mm512_storeu_ps(out + i * kBfCols + nb * kRows, y);
    }
}

template <int NB>
void bf16dp_strip(int mt, const uint16_t* const* blocks, int64_t pstride, bool in_place, const float* sc,
                  int64_t planes, const uint16_t* x, int64_t ldx, const float* xsum, int64_t groups, int64_t ppg,
                  float* out) {
  if (groups == 1) {
    switch (mt) {
#define KILAT_BF_ONE(MT) \
      case MT: return bf16dp_rows_one<MT, NB>(blocks, pstride, in_place, sc, planes, x, ldx, xsum, ppg, out);
      KILAT_BF_ONE(12) KILAT_BF_ONE(11) KILAT_BF_ONE(10) KILAT_BF_ONE(9) KILAT_BF_ONE(8) KILAT_BF_ONE(7)
      KILAT_BF_ONE(6) KILAT_BF_ONE(5) KILAT_BF_ONE(4) KILAT_BF_ONE(3) KILAT_BF_ONE(2)
#undef KILAT_BF_ONE
      default: return bf16dp_rows_one<1, NB>(blocks, pstride, in_place, sc, planes, x, ldx, xsum, ppg, out);
    }
  }
  switch (mt) {
    case 6: bf16dp_rows<6, NB>(blocks, pstride, sc, planes, x, ldx, xsum, groups, ppg, out); break;
    case 5: bf16dp_rows<5, NB>(blocks, pstride, sc, planes, x, ldx, xsum, groups, ppg, out); break;
    case 4: bf16dp_rows<4, NB>(blocks, pstride, sc, planes, x, ldx, xsum, groups, ppg, out); break;
    case 3: bf16dp_rows<3, NB>(blocks, pstride, sc, planes, x, ldx, xsum, groups, ppg, out); break;
    case 2: bf16dp_rows<2, NB>(blocks, pstride, sc, planes, x, ldx, xsum, groups, ppg, out); break;
    default: bf16dp_rows<1, NB>(blocks, pstride, sc, planes, x, ldx, xsum, groups, ppg, out); break;
  }
}

template <typename S>
void run_gemm_bf16dp(const at::Tensor& x, const uint8_t* qw, const S* sz, const Layout& l, const float* bias,
                     at::Tensor& out) {
  const int64_t m = x.size(0), kp = l.chunks * kCols;
  const auto* xin = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  std::vector<uint16_t> padded;  // x with zero columns up to Kp (the padded weights are 0)
  if (kp != l.k) {
    padded.assign(m * kp, 0);
    for (int64_t r = 0; r < m; ++r) std::memcpy(&padded[r * kp], xin + r * l.k, l.k * sizeof(uint16_t));
  }
  const uint16_t* xp = kp != l.k ? padded.data() : xin;
  std::vector<float> xsum(l.planes == 2 ? m * l.groups : 0);
  if (l.planes == 2)
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < l.groups; ++g) {
          __m512 s = _mm512_setzero_ps();
          for (int64_t c = g * l.span; c < (g + 1) * l.span; c += 16) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + r * kp + c));
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
          }
          xsum[r * l.groups + g] = _mm512_reduce_add_ps(s);
        }
    });
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t units = (l.blocks + kBfBlocks - 1) / kBfBlocks, ppg = l.span / 2;
  const int64_t strip = l.groups == 1 ? kBfMTOne : kBfMT;
  // A narrow layer (a MoE router, a shared-expert gate: one or two units) would leave threads idle: its rows of x are
  // split too, in parts of at least 64 rows, each task unpacking its unit for its part.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = units >= threads ? 1 : std::max<int64_t>(1, std::min((threads + units - 1) / units, m / 64));
  const int64_t part_rows = ((m + parts - 1) / parts + kBfMTOne - 1) / kBfMTOne * kBfMTOne;  // whole strips of 6 or 12
  at::parallel_for(0, units * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> tile(l.bits == 16 ? 0 : kp * kBfBlocks * kRows);
    std::vector<float> sc(l.groups * l.planes * kBfBlocks * kRows);
    alignas(64) float yb[kBfMTOne * kBfCols];
    const uint16_t* blocks[kBfBlocks];
    int64_t unpacked = -1;  // the unit in tile and sc
    for (int64_t task = begin; task < end; ++task) {
      const int64_t u = task / parts, m_begin = (task % parts) * part_rows, m_end = std::min(m, m_begin + part_rows);
      const int64_t blk0 = u * kBfBlocks, nb = std::min<int64_t>(kBfBlocks, l.blocks - blk0);
      // 16-bit weights are read in place (their chunks are already pairs); 4- and 8-bit ones unpacked into the tile
      const bool in_place = l.bits == 16;
      const int64_t pstride = in_place ? 32 : nb * 32;
      for (int64_t b = 0; b < nb && unpacked != u; ++b) {
        const uint8_t* bq = qw + (blk0 + b) * l.chunks * l.chunk_bytes;
        blocks[b] = in_place ? reinterpret_cast<const uint16_t*>(bq) : tile.data() + 32 * b;
        if (l.bits == 4) unpack_bf16<4>(bq, l, tile.data() + 32 * b, nb * 32);
        else if (l.bits == 8) unpack_bf16<8>(bq, l, tile.data() + 32 * b, nb * 32);
        for (int64_t g = 0; g < l.groups; ++g)
          for (int w = 0; w < l.planes; ++w)
            for (int r = 0; r < kRows; ++r)
              sc[(g * l.planes + w) * nb * kRows + b * kRows + r] = scale_at(sz, l, blk0 + b, g, w, r);
      }
      unpacked = u;
      for (int64_t m0 = m_begin; m0 < m_end; m0 += strip) {
        const int mt = static_cast<int>(std::min<int64_t>(strip, m_end - m0));
        const float* xs = l.planes == 2 ? &xsum[m0 * l.groups] : nullptr;
        if (nb == kBfBlocks)
          bf16dp_strip<kBfBlocks>(mt, blocks, pstride, in_place, sc.data(), l.planes, xp + m0 * kp, kp, xs, l.groups,
                                  ppg, yb);
        else
          bf16dp_strip<1>(mt, blocks, pstride, in_place, sc.data(), l.planes, xp + m0 * kp, kp, xs, l.groups, ppg, yb);
        for (int i = 0; i < mt; ++i)
          for (int64_t b = 0; b < nb; ++b) {
            const int64_t n0 = (blk0 + b) * kRows;
            const __mmask16 keep = static_cast<__mmask16>((1u << std::min<int64_t>(kRows, l.n - n0)) - 1);
            __m512 v = _mm512_loadu_ps(yb + i * kBfCols + b * kRows);
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + n0));
            _mm256_mask_storeu_epi16(yp + (m0 + i) * l.n + n0, keep, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
          }
      }
    }
  });
}
#endif

template <typename S>
void run_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const Layout& l,
              const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  at::Tensor biasf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = biasf.defined() ? biasf.data_ptr<float>() : nullptr;
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  const S* sz = reinterpret_cast<const S*>(scales.data_ptr());
#ifdef KILAT_BF16DP
  if (x.scalar_type() == at::kBFloat16 && x.size(0) >= bf16dp_min_rows(l.bits)) return run_gemm_bf16dp<S>(x, qw, sz, l, bp, out);
#endif
#ifdef KILAT_AVX2
  [[maybe_unused]] const bool tile = x.size(0) >= kTileRows;
#else
  TORCH_CHECK(l.bits != 16, "16-bit (dense bfloat16) weights need bfloat16 x and the AVX512-BF16 build, or AVX2");
  [[maybe_unused]] const bool tile = false;
#endif
#ifdef KILAT_INT_PATH
  const bool split = !tile && x.scalar_type() != at::kFloat && l.bits != 16;
#else
  const bool split = false;
#endif
  const Activations a = prepare(x, l, split);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "gemm", [&] {
  scalar_t* yp = out.data_ptr<scalar_t>();
  at::parallel_for(0, l.blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> yb(a.m * kRows), t;
    for (int64_t blk = begin; blk < end; ++blk) {
#if defined(KILAT_VNNI)
      if (split && l.bits == 4) gemm_block_split<4, S>(a, qw, sz, l, blk, yb.data());
      else if (split) gemm_block_split<8, S>(a, qw, sz, l, blk, yb.data());
      else if (l.bits == 4) gemm_block_avx512<4, S>(a, qw, sz, l, blk, yb.data());
      else gemm_block_avx512<8, S>(a, qw, sz, l, blk, yb.data());
#elif defined(KILAT_AVX512)
      if (l.bits == 4) gemm_block_avx512<4, S>(a, qw, sz, l, blk, yb.data());
      else gemm_block_avx512<8, S>(a, qw, sz, l, blk, yb.data());
#elif defined(KILAT_AVX2)
      if (tile) gemm_block_tile_avx2<S>(a, qw, sz, l, blk, t, yb.data());
      else if (l.bits == 16) gemm_block_avx2<16, S>(a, qw, sz, l, blk, yb.data());
      else if (split && l.bits == 4) gemm_block_int_avx2<4, S>(a, qw, sz, l, blk, yb.data());
      else if (split) gemm_block_int_avx2<8, S>(a, qw, sz, l, blk, yb.data());
      else if (l.bits == 4) gemm_block_avx2<4, S>(a, qw, sz, l, blk, yb.data());
      else gemm_block_avx2<8, S>(a, qw, sz, l, blk, yb.data());
#else
      gemm_block_ref<S>(a, qw, sz, l, blk, yb.data());
#endif
      const int64_t rows = std::min(kRows, l.n - blk * kRows);
      for (int64_t m = 0; m < a.m; ++m)
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = blk * kRows + r;
          yp[m * l.n + n] = static_cast<scalar_t>(yb[m * kRows + r] + (bp ? bp[n] : 0.f));
        }
    }
  });
  });
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                int64_t group_size, int64_t n, int64_t k, const c10::optional<at::Tensor>& bias) {
  Layout l = layout_of(qweight, scales, bits, group_size, n, k);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x must be [..., K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16");
  const at::Tensor x2 = x.contiguous().view({-1, k});
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (x2.size(0) == 0) return out;
  if (scales.scalar_type() == at::kHalf)
    run_gemm<c10::Half>(x2, qweight, scales, l, bias, out);
  else
    run_gemm<float>(x2, qweight, scales, l, bias, out);
  return out;
}

template <typename S, typename T>
void run_dequantize(const uint8_t* qw, const S* sz, const Layout& l, T* out) {
  at::parallel_for(0, l.blocks, 1, [&](int64_t begin, int64_t end) {
    float tile[16][kRows];  // 16 columns x 16 rows
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t rows = std::min(kRows, l.n - blk * kRows);
      for (int64_t c0 = 0; c0 < l.k; c0 += 16) {
        dequantize_tile(qw, sz, l, blk, c0, tile);
        const int64_t cols = std::min<int64_t>(16, l.k - c0);
        for (int64_t r = 0; r < rows; ++r) {
          T* o = out + (blk * kRows + r) * l.k + c0;
          for (int64_t j = 0; j < cols; ++j) o[j] = static_cast<T>(tile[j][r]);
        }
      }
    }
  });
}

at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, int64_t bits, int64_t group_size,
                      int64_t n, int64_t k, at::ScalarType dtype) {
  Layout l = layout_of(qweight, scales, bits, group_size, n, k);
  at::Tensor out = at::empty({n, k}, qweight.options().dtype(dtype));
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  auto go = [&](auto* o) {
    if (scales.scalar_type() == at::kHalf)
      run_dequantize(qw, scales.data_ptr<c10::Half>(), l, o);
    else
      run_dequantize(qw, scales.data_ptr<float>(), l, o);
  };
  if (dtype == at::kFloat)
    go(out.data_ptr<float>());
  else if (dtype == at::kBFloat16)
    go(out.data_ptr<c10::BFloat16>());
  else if (dtype == at::kHalf)
    go(out.data_ptr<c10::Half>());
  else
    TORCH_CHECK(false, "dequantize: dtype must be float32, bfloat16 or float16");
  return out;
}

at::Tensor embedding(const at::Tensor& ids, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                     int64_t group_size, int64_t n, int64_t k, at::ScalarType dtype) {
  Layout l = layout_of(qweight, scales, bits, group_size, n, k);
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids must be int64");
  const at::Tensor flat = ids.contiguous().view({-1});
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < flat.numel(); ++t) TORCH_CHECK(id[t] >= 0 && id[t] < n, "ids must be in [0, N)");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, qweight.options().dtype(dtype));
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "embedding", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    auto rows = [&](auto* sz) {
      at::parallel_for(0, flat.numel(), 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t blk = id[t] / kRows;
          const int r = static_cast<int>(id[t] % kRows);
          const uint8_t* bq = qw + blk * l.chunks * l.chunk_bytes;
          if (l.bits == 16) {
            for (int64_t c = 0; c < l.k; ++c) o[t * l.k + c] = static_cast<scalar_t>(dense_at(bq, r, c));
            continue;
          }
          for (int64_t c = 0; c < l.k; ++c) {
            const int64_t g = c / l.span;  // q * s + z rounded twice, as torch computes it
            o[t * l.k + c] = static_cast<scalar_t>(static_cast<float>(q_at(bq, l, r, c)) * scale_at(sz, l, blk, g, 0, r) +
                                                   scale_at(sz, l, blk, g, 1, r));
          }
        }
      });
    };
    if (scales.scalar_type() == at::kHalf)
      rows(scales.data_ptr<c10::Half>());
    else
      rows(scales.data_ptr<float>());
  });
  return out;
}

bool has_vnni() {
#ifdef KILAT_VNNI
  return true;
#else
  return false;
#endif
}

bool has_bf16dp() {
#ifdef KILAT_BF16DP
  return true;
#else
  return false;
#endif
}

bool has_avx2() {
#ifdef KILAT_AVX2
  return true;
#else
  return false;
#endif
}

bool has_dense16() {
#if defined(KILAT_BF16DP) || defined(KILAT_AVX2)
  return true;
#else
  return false;
#endif
}

bool has_avx512() {
#ifdef KILAT_AVX512
  return true;
#else
  return false;
#endif
}

}  // namespace

KILAT_LIBRARY(kilat_quant, m) {
  m.def("gemm(Tensor x, Tensor qweight, Tensor scales, int bits, int group_size, int n, int k, Tensor? bias) -> Tensor",
        gemm);
  m.def("dequantize(Tensor qweight, Tensor scales, int bits, int group_size, int n, int k, ScalarType dtype) -> Tensor",
        dequantize);
  m.def("embedding(Tensor ids, Tensor qweight, Tensor scales, int bits, int group_size, int n, int k, ScalarType dtype) "
        "-> Tensor", embedding);
  m.def("has_avx512() -> bool", has_avx512);
  m.def("has_vnni() -> bool", has_vnni);
  m.def("has_avx2() -> bool", has_avx2);
  m.def("has_bf16dp() -> bool", has_bf16dp);
  m.def("has_dense16() -> bool", has_dense16);
}
