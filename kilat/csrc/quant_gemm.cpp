// Weight-quantized matmul for CPU: y[m, n] = sum_g scale[n, g] * (sum_{k in g} q[n, k] x[m, k])
//                                           + zero[n, g] * (sum_{k in g} x[m, k])
// over the packed layout of kilat/model_executor/layers/quantization/kernels.py (rows in blocks of 16, 32-byte
// chunks of 16 rows x 2 or 4 columns, scales [Np/16, groups, 2, 16] in float16 or float32).
//
// AVX-512 path (AVX512BW + AVX512_BF16): the integer q is exact in bfloat16, so `vdpbf16ps` with a 16-row x
// 2-column weight vector and a broadcast pair of x computes exact products summed in float32, one output row per
// lane (no horizontal sums). A float32 x is split into three bfloat16 parts whose sum is exactly x. Other CPUs
// use the portable loops below (same arithmetic, float32). Threads: at::parallel_for over row blocks (torch's
// intra-op thread count).
//
// Ops (namespace kilat_quant): gemm(x [M, K] float32|bfloat16, qweight, scales, bits, group_size, N, K, bias?)
// -> [M, N] in x's dtype; dequantize(qweight, scales, bits, group_size, N, K, dtype) -> [N, K];
// has_avx512bf16() -> whether the vector path was compiled in.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KILAT_AVX512BF16 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 16;
constexpr int64_t kChunk = 32;

inline uint16_t bf16_rne(float f) { return c10::BFloat16(f).x; }  // round to nearest even

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Layout {
  int64_t bits, cols, chunks, groups, span, n, k, blocks;
};

Layout layout_of(const at::Tensor& qweight, const at::Tensor& scales, int64_t bits, int64_t group_size, int64_t n,
                 int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qweight.dtype() == at::kByte && qweight.dim() == 3 && qweight.size(2) == kChunk &&
                  qweight.is_contiguous(), "qweight must be contiguous uint8 [Np/16, chunks, 32]");
  TORCH_CHECK((scales.dtype() == at::kHalf || scales.dtype() == at::kFloat) && scales.dim() == 4 &&
                  scales.size(0) == qweight.size(0) && scales.size(2) == 2 && scales.size(3) == kRows &&
                  scales.is_contiguous(), "scales must be contiguous float16/float32 [Np/16, groups, 2, 16]");
  Layout l;
  l.bits = bits;
  l.cols = bits == 4 ? 4 : 2;
  l.chunks = qweight.size(1);
  l.groups = scales.size(1);
  l.span = l.groups == 1 ? l.chunks * l.cols : group_size;
  l.n = n;
  l.k = k;
  l.blocks = qweight.size(0);
  TORCH_CHECK(l.span * l.groups == l.chunks * l.cols && l.span % l.cols == 0, "group size does not fit qweight");
  TORCH_CHECK(n <= l.blocks * kRows && k <= l.chunks * l.cols, "N/K do not fit qweight");
  return l;
}

// q of row `r` (0..15), column `c` of row block `blk` (bytes of that block).
inline int q_at(const uint8_t* blk, const Layout& l, int r, int64_t c) {
  const uint8_t* chunk = blk + (c / l.cols) * kChunk;
  int64_t j = c % l.cols;
  if (l.bits == 8) return static_cast<int8_t>(chunk[2 * r + j]);
  uint8_t b = chunk[2 * r + (j & 1)];
  return j < 2 ? (b & 0x0F) : (b >> 4);
}

template <typename S>
inline float scale_at(const S* sz, const Layout& l, int64_t blk, int64_t g, int which, int r) {
  return static_cast<float>(sz[((blk * l.groups + g) * 2 + which) * kRows + r]);
}

// ---------------------------------------------------------------------------------------------- portable path
template <typename S>
void gemm_block_ref(const float* x, int64_t m_total, int64_t kp, const uint8_t* qw, const S* sz, const Layout& l,
                    int64_t blk, float* y /* [M, 16] */) {
  const uint8_t* bq = qw + blk * l.chunks * kChunk;
  for (int r = 0; r < kRows; ++r) {
    for (int64_t m = 0; m < m_total; ++m) {
      const float* xm = x + m * kp;
      float acc = 0.f;
      for (int64_t g = 0; g < l.groups; ++g) {
        float dot = 0.f, xs = 0.f;
        for (int64_t c = g * l.span; c < (g + 1) * l.span; ++c) {
          dot += static_cast<float>(q_at(bq, l, r, c)) * xm[c];
          xs += xm[c];
        }
        acc += scale_at(sz, l, blk, g, 0, r) * dot + scale_at(sz, l, blk, g, 1, r) * xs;
      }
      y[m * kRows + r] = acc;
    }
  }
}

#ifdef KILAT_AVX512BF16
// ------------------------------------------------------------------------------------------------ AVX-512 path
// xq: [Kp/2 pairs][M][P] dwords (a bfloat16 pair of x per part); xsum: [M][groups] float.
template <int BITS, int MT, int P, typename S>
void gemm_block_avx512(const uint32_t* xq, const float* xsum, int64_t m_total, int64_t m0, const uint8_t* qw,
                       const S* sz, const Layout& l, int64_t blk, float* y /* [M, 16] */) {
  const uint8_t* bq = qw + blk * l.chunks * kChunk;
  const int64_t chunks_per_group = l.span / l.cols;
  const int64_t stride = m_total * P;  // dwords per pair
  alignas(64) static const uint16_t kTable[32] = {
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120,
      0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};  // bf16(0..15)
  const __m512i table = _mm512_load_si512(kTable);
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < l.groups; ++g) {
    __m512 dot[MT];
    for (int i = 0; i < MT; ++i) dot[i] = _mm512_setzero_ps();
    const uint8_t* wp = bq + g * chunks_per_group * kChunk;
    const uint32_t* xp = xq + (g * l.span / 2) * stride + m0 * P;
    for (int64_t c = 0; c < chunks_per_group; ++c, wp += kChunk) {
      if constexpr (BITS == 4) {
        _mm_prefetch(reinterpret_cast<const char*>(wp) + 1024, _MM_HINT_T0);
        const __m512i wd = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)));
        const __m512bh wlo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(wd, low4), table);
        const __m512bh whi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 4), table);
        for (int i = 0; i < MT; ++i)
          for (int p = 0; p < P; ++p) {
            dot[i] = _mm512_dpbf16_ps(dot[i], wlo, (__m512bh)_mm512_set1_epi32(xp[i * P + p]));
            dot[i] = _mm512_dpbf16_ps(dot[i], whi, (__m512bh)_mm512_set1_epi32(xp[stride + i * P + p]));
          }
        xp += 2 * stride;
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(wp) + 1024, _MM_HINT_T0);
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp))));
        const __m512 f1 =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16))));
        const __m512bh w = _mm512_cvtne2ps_pbh(f1, f0);
        for (int i = 0; i < MT; ++i)
          for (int p = 0; p < P; ++p)
            dot[i] = _mm512_dpbf16_ps(dot[i], w, (__m512bh)_mm512_set1_epi32(xp[i * P + p]));
        xp += stride;
      }
    }
    const S* s = sz + (blk * l.groups + g) * 2 * kRows;
    __m512 sv, zv;
    if constexpr (sizeof(S) == 2) {
      sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      zv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kRows)));
    } else {
      sv = _mm512_loadu_ps(reinterpret_cast<const float*>(s));
      zv = _mm512_loadu_ps(reinterpret_cast<const float*>(s) + kRows);
    }
    for (int i = 0; i < MT; ++i) {
      acc[i] = _mm512_fmadd_ps(dot[i], sv, acc[i]);
      acc[i] = _mm512_fmadd_ps(zv, _mm512_set1_ps(xsum[(m0 + i) * l.groups + g]), acc[i]);
    }
  }
  for (int i = 0; i < MT; ++i) _mm512_storeu_ps(y + (m0 + i) * kRows, acc[i]);
}

template <int BITS, int P, typename S>
void gemm_block_tiles(const uint32_t* xq, const float* xsum, int64_t m_total, const uint8_t* qw, const S* sz,
                      const Layout& l, int64_t blk, float* y) {
  int64_t m0 = 0;
  for (; m0 + 8 <= m_total; m0 += 8) gemm_block_avx512<BITS, 8, P, S>(xq, xsum, m_total, m0, qw, sz, l, blk, y);
  if (m0 + 4 <= m_total) {
    gemm_block_avx512<BITS, 4, P, S>(xq, xsum, m_total, m0, qw, sz, l, blk, y);
    m0 += 4;
  }
  if (m0 + 2 <= m_total) {
    gemm_block_avx512<BITS, 2, P, S>(xq, xsum, m_total, m0, qw, sz, l, blk, y);
    m0 += 2;
  }
  if (m0 < m_total) gemm_block_avx512<BITS, 1, P, S>(xq, xsum, m_total, m0, qw, sz, l, blk, y);
}
#endif

template <typename S>
void run_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const Layout& l,
              const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t m_total = x.size(0);
  const int64_t kp = l.chunks * l.cols;
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  const S* sz = reinterpret_cast<const S*>(scales.data_ptr());
  at::Tensor biasf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = biasf.defined() ? biasf.data_ptr<float>() : nullptr;

  // x in float32, zero-padded to Kp: [M, Kp]
  std::vector<float> xf(m_total * kp, 0.f);
  for (int64_t m = 0; m < m_total; ++m) {
    if (is_bf16) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr()) + m * l.k;
      for (int64_t c = 0; c < l.k; ++c) xf[m * kp + c] = bf16_to_float(src[c]);
    } else {
      std::memcpy(&xf[m * kp], x.data_ptr<float>() + m * l.k, l.k * sizeof(float));
    }
  }
  auto finish = [&](int64_t blk, const float* yb) {  // yb [M, 16] -> out rows of block blk (+ bias)
    for (int64_t m = 0; m < m_total; ++m)
      for (int r = 0; r < kRows; ++r) {
        int64_t n = blk * kRows + r;
        if (n >= l.n) break;
        float v = yb[m * kRows + r] + (bp ? bp[n] : 0.f);
        if (is_bf16)
          reinterpret_cast<uint16_t*>(out.data_ptr())[m * l.n + n] = bf16_rne(v);
        else
          out.data_ptr<float>()[m * l.n + n] = v;
      }
  };

#ifdef KILAT_AVX512BF16
  const int parts = is_bf16 ? 1 : 3;
  std::vector<uint32_t> xq((kp / 2) * m_total * parts);
  std::vector<float> xsum(m_total * l.groups, 0.f);
  for (int64_t m = 0; m < m_total; ++m) {
    const float* xm = &xf[m * kp];
    for (int64_t g = 0; g < l.groups; ++g) {
      float s = 0.f;
      for (int64_t c = g * l.span; c < (g + 1) * l.span; ++c) s += xm[c];
      xsum[m * l.groups + g] = s;
    }
    for (int64_t p = 0; p < kp / 2; ++p) {
      float a = xm[2 * p], b = xm[2 * p + 1];
      for (int part = 0; part < parts; ++part) {
        uint16_t ha = bf16_rne(a), hb = bf16_rne(b);
        xq[(p * m_total + m) * parts + part] = static_cast<uint32_t>(ha) | (static_cast<uint32_t>(hb) << 16);
        a -= bf16_to_float(ha);  // exact: the remainder of a float32 after its leading bfloat16
        b -= bf16_to_float(hb);
      }
    }
  }
  at::parallel_for(0, l.blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> yb(m_total * kRows);
    for (int64_t blk = begin; blk < end; ++blk) {
      if (l.bits == 4) {
        if (parts == 1) gemm_block_tiles<4, 1, S>(xq.data(), xsum.data(), m_total, qw, sz, l, blk, yb.data());
        else gemm_block_tiles<4, 3, S>(xq.data(), xsum.data(), m_total, qw, sz, l, blk, yb.data());
      } else {
        if (parts == 1) gemm_block_tiles<8, 1, S>(xq.data(), xsum.data(), m_total, qw, sz, l, blk, yb.data());
        else gemm_block_tiles<8, 3, S>(xq.data(), xsum.data(), m_total, qw, sz, l, blk, yb.data());
      }
      finish(blk, yb.data());
    }
  });
#else
  at::parallel_for(0, l.blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> yb(m_total * kRows);
    for (int64_t blk = begin; blk < end; ++blk) {
      gemm_block_ref<S>(xf.data(), m_total, kp, qw, sz, l, blk, yb.data());
      finish(blk, yb.data());
    }
  });
#endif
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                int64_t group_size, int64_t n, int64_t k, const c10::optional<at::Tensor>& bias) {
  Layout l = layout_of(qweight, scales, bits, group_size, n, k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous(), "x must be contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  if (scales.scalar_type() == at::kHalf)
    run_gemm<c10::Half>(x, qweight, scales, l, bias, out);
  else
    run_gemm<float>(x, qweight, scales, l, bias, out);
  return out;
}

template <typename S, typename T>
void run_dequantize(const uint8_t* qw, const S* sz, const Layout& l, T* out) {
  at::parallel_for(0, l.blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const uint8_t* bq = qw + blk * l.chunks * kChunk;
      for (int r = 0; r < kRows; ++r) {
        int64_t n = blk * kRows + r;
        if (n >= l.n) break;
        for (int64_t g = 0; g < l.groups; ++g) {
          float s = scale_at(sz, l, blk, g, 0, r), z = scale_at(sz, l, blk, g, 1, r);
          int64_t stop = std::min((g + 1) * l.span, l.k);
          for (int64_t c = g * l.span; c < stop; ++c) {
            float q = static_cast<float>(q_at(bq, l, r, c));
            out[n * l.k + c] = static_cast<T>(q * s + z);
          }
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
  if (dtype == at::kFloat) go(out.data_ptr<float>());
  else if (dtype == at::kBFloat16) go(out.data_ptr<c10::BFloat16>());
  else if (dtype == at::kHalf) go(out.data_ptr<c10::Half>());
  else TORCH_CHECK(false, "dequantize: dtype must be float32, bfloat16 or float16");
  return out;
}

bool has_avx512bf16() {
#ifdef KILAT_AVX512BF16
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(kilat_quant, m) {
  m.def("gemm(Tensor x, Tensor qweight, Tensor scales, int bits, int group_size, int n, int k, Tensor? bias) -> Tensor",
        gemm);
  m.def("dequantize(Tensor qweight, Tensor scales, int bits, int group_size, int n, int k, ScalarType dtype) -> Tensor",
        dequantize);
  m.def("has_avx512bf16() -> bool", has_avx512bf16);
}
