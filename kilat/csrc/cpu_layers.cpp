// The decoder's small per-layer operations for CPU, one op each instead of a chain of torch ops (a batch-1 decode
// step is dispatch-bound): RMSNorm with the residual add, rotary embedding, SiLU-and-mul. Every op rounds exactly
// where HF transformers' formulas round (a product or sum of two values is computed in float32 and rounded to the
// dtype, as torch's element-wise ops on bfloat16/float16 do), so float32 results equal HF's up to the order of the
// RMSNorm sum and bfloat16 results equal HF's bit for bit but for that sum's last-bit differences.
//
// Ops (namespace kilat_cpu_<isa>; x of dtype float32, bfloat16 or float16; "r(v)" rounds a float32 v to x's dtype, to
// nearest even, and is the identity for float32; the last dimension of every input must be contiguous, other
// strides are free; outputs are new contiguous tensors in x's dtype):
//   rms_norm(x [..., H], weight [H], eps) -> [..., H]: per row, inv = 1 / sqrt(sum(x^2) / H + eps) (float32, eps
//     rounded to float32), out = r(r(x * inv) * weight)  (HF LlamaRMSNorm: normalize in float32, cast to the input
//     dtype, multiply by the weight in that dtype).
//   add_rms_norm(x [..., H], residual [..., H], weight [H], eps) -> (rms_norm(s), s) with s = r(x + residual) (the
//     residual stream stays in the model dtype, as HF's decoder layer adds it).
//   rotary(x [T, heads, D], cos [T, 1, D] or [T, D], sin (same)) -> [T, heads, D]: with h = D / 2 and sin
//     sign-folded (sin[:h] negated, kilat's RotaryEmbedding table), out[i] = r(r(x[i] * cos[i]) + r(x[(i + h) % D] *
//     sin[i]))  (HF's q * cos + rotate_half(q) * sin: rotate_half's negation is exact, so folding it into sin
//     changes no rounding). cos/sin of another dtype are converted to x's first.
//   silu_and_mul(x [..., 2I]) -> [..., I]: out = r(r(silu(g)) * u), g = x[..., :I], u = x[..., I:], silu(g) =
//     g / (1 + exp(-g)) in float32 (HF's act_fn(gate) * up; exp to about 1 ulp, so float32 may differ from torch's
//     in the last bit).
//   argmax(x [B, V]) -> int64 [B]: per row, the index of the first maximum, or of the first NaN when the row has one
//     (torch.argmax's rule; bfloat16/float16 values compare as their exact float32 widening, so the pick equals
//     the argmax of x.float()); the greedy sampler's pick, at the memory's speed (torch's CPU argmax reads a batch's
//     logits at about a third of it).
//
// AVX-512 (F, BW, VL) code paths, AVX2 (with FMA and F16C) ones for rows whose length is a multiple of 8 (their
// RMSNorm sum in the AVX-512 path's 16 lanes and tree order), portable loops otherwise (same arithmetic, the RMSNorm
// sum in the same order, only the SiLU's exp differing in its last bit).
// Threads: at::parallel_for over rows, with a grain that keeps a decode step's few rows on the calling thread.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kilat_library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KILAT_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KILAT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGrainElements = 1 << 15;  // elements per thread before at::parallel_for splits rows

template <typename T>
inline float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Rows of a 2-D or 3-D tensor (last dimension contiguous): row r is element (r / inner, r % inner).
template <typename T>
struct Rows {
  T* base;
  int64_t inner, stride0, stride1;

  Rows(const at::Tensor& t) : base(static_cast<T*>(t.data_ptr())) {
    inner = t.dim() == 3 ? t.size(1) : 1;
    stride0 = t.stride(0);
    stride1 = t.dim() == 3 ? t.stride(1) : 0;
  }
  T* operator[](int64_t r) const { return base + (r / inner) * stride0 + (r % inner) * stride1; }
};

// x as a 2-D or 3-D tensor with a contiguous last dimension (other ranks are reshaped; a copy only if needed).
at::Tensor as_rows(const at::Tensor& x) {
  const at::Tensor t = x.dim() == 2 || x.dim() == 3 ? x : x.reshape({-1, x.size(-1)});
  return t.stride(-1) == 1 ? t : t.contiguous();
}

// t in dtype with a contiguous last dimension (itself when it already is: no dispatcher call on the hot path).
// Whether the ops compute in `dtype` (their vector helpers know float32, bfloat16 and float16 only).
bool supported(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

at::Tensor with_dtype(const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), "every input must be a CPU tensor");
  TORCH_CHECK(supported(dtype), "x must be float32, bfloat16 or float16");
  at::Tensor r = t.scalar_type() == dtype ? t : t.to(dtype);
  return r.stride(-1) == 1 ? r : r.contiguous();
}

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

#ifdef KILAT_AVX512
// --------------------------------------------------------------------------------------- AVX-512 lane helpers
inline __mmask16 tail(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

template <typename T>
inline __m512 vload(const T* p, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
}

// float32 -> bfloat16 bits, to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

template <typename T>
inline void vstore(T* p, __m512 v, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>)
    _mm512_mask_storeu_ps(p, m, v);
  else if constexpr (std::is_same_v<T, c10::BFloat16>)
    _mm256_mask_storeu_epi16(p, m, to_bf16(v));
  else
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// r(v): v rounded to T and widened back.
template <typename T>
inline __m512 vrnd(__m512 v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else if constexpr (std::is_same_v<T, c10::BFloat16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
  else
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) in float32 (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, degree-7 polynomial, times 2^n): about 1 ulp.
inline __m512 vexp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);  // saturates to inf / 0 outside float32's range
}
#endif

#ifdef KILAT_AVX2
// ------------------------------------------------------------------------------------------ AVX2 lane helpers
template <typename T>
inline __m256 vload8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// float32 -> bfloat16 bits in the low half of each 32-bit lane, to nearest even, NaN -> 0x7FC0 (c10's conversion).
inline __m256i bf16_lanes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)),
                                              _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

template <typename T>
inline void vstore8(T* p, __m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i r = bf16_lanes(v);  // packus works per 128-bit lane: [0-3 0-3 | 4-7 4-7], then 0-3 4-7 in front
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <typename T>
inline __m256 vrnd8(__m256 v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else if constexpr (std::is_same_v<T, c10::BFloat16>)
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_lanes(v), 16));
  else
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// vexp on 8 lanes; 2^n (n in [-150, 129]) as 2^a 2^b, each a normal float, so the product rounds once, as scalef.
inline __m256 vexp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.f)), _mm256_set1_ps(89.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i a = _mm256_srai_epi32(ni, 1), b = _mm256_sub_epi32(ni, a);
  const __m256 pa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(127)), 23));
  const __m256 pb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, pa), pb);
}

// The 16 lanes lo (0-7) and hi (8-15) summed as _mm512_reduce_add_ps sums them: j += j + 8, + 4, + 2, + 1.
inline float tree_sum16(__m256 lo, __m256 hi) {
  const __m256 t = _mm256_add_ps(lo, hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// ------------------------------------------------------------------------------------------------------ RMSNorm
// One row: s = r(x + residual) (stored to s_out) when residual is given, else s = x; out = r(r(s * inv) * w).
template <typename T>
void rms_norm_row(const T* x, const T* residual, const T* w, T* out, T* s_out, int64_t h, float eps) {
#ifdef KILAT_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = tail(h - i);
    __m512 s = vload(x + i, m);
    if (residual != nullptr) {
      s = vrnd<T>(_mm512_add_ps(s, vload(residual + i, m)));
      vstore(s_out + i, s, m);
    }
    acc = _mm512_add_ps(acc, _mm512_mul_ps(s, s));
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(h) + eps);
  const T* src = residual != nullptr ? s_out : x;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = tail(h - i);
    vstore(out + i, vrnd<T>(_mm512_mul_ps(vrnd<T>(_mm512_mul_ps(vload(src + i, m), vinv)), vload(w + i, m))), m);
  }
#else
#ifdef KILAT_AVX2
  if (h % 8 == 0) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes 0-7 and 8-15 of the AVX-512 path's sum
    for (int64_t i = 0; i < h; i += 8) {
      __m256 s = vload8(x + i);
      if (residual != nullptr) {
        s = vrnd8<T>(_mm256_add_ps(s, vload8(residual + i)));
        vstore8(s_out + i, s);
      }
      acc[(i / 8) % 2] = _mm256_add_ps(acc[(i / 8) % 2], _mm256_mul_ps(s, s));
    }
    const float inv = 1.f / std::sqrt(tree_sum16(acc[0], acc[1]) / static_cast<float>(h) + eps);
    const T* src = residual != nullptr ? s_out : x;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < h; i += 8)
      vstore8(out + i, vrnd8<T>(_mm256_mul_ps(vrnd8<T>(_mm256_mul_ps(vload8(src + i), vinv)), vload8(w + i))));
    return;
  }
#endif
  float acc[16] = {};  // 16 lanes summed as the vector path sums them, then folded in its tree order
  for (int64_t i = 0; i < h; ++i) {
    float s = static_cast<float>(x[i]);
    if (residual != nullptr) {
      s = rnd<T>(s + static_cast<float>(residual[i]));
      s_out[i] = static_cast<T>(s);
    }
    acc[i % 16] += s * s;
  }
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  const float inv = 1.f / std::sqrt(acc[0] / static_cast<float>(h) + eps);
  const T* src = residual != nullptr ? s_out : x;
  for (int64_t i = 0; i < h; ++i)
    out[i] = static_cast<T>(rnd<T>(static_cast<float>(src[i]) * inv) * static_cast<float>(w[i]));
#endif
}

std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x_in, const c10::optional<at::Tensor>& res_in,
                                                 const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() >= 1, "x must be a CPU tensor [..., H]");
  const int64_t h = x_in.size(-1);
  TORCH_CHECK(weight_in.dim() == 1 && weight_in.size(0) == h, "weight must be [H]");
  const at::Tensor x = as_rows(x_in);
  const at::Tensor weight = with_dtype(weight_in, x.scalar_type());
  at::Tensor residual;
  if (res_in.has_value()) {
    TORCH_CHECK(res_in->sizes() == x_in.sizes(), "residual must have x's shape");
    residual = as_rows(with_dtype(*res_in, x.scalar_type()));
    TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape");
  }
  at::Tensor out = at::empty(x_in.sizes(), x.options());
  at::Tensor added = residual.defined() ? at::empty(x_in.sizes(), x.options()) : at::Tensor();
  const int64_t rows = h == 0 ? 0 : x.numel() / h;
  const float feps = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const Rows<scalar_t> xr(x);
    const c10::optional<Rows<scalar_t>> rr = residual.defined() ? c10::optional<Rows<scalar_t>>(Rows<scalar_t>(residual))
                                                                : c10::nullopt;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    scalar_t* a = added.defined() ? added.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row<scalar_t>(xr[r], rr ? (*rr)[r] : nullptr, w, o + r * h, a ? a + r * h : nullptr, h, feps);
    });
  });
  return {out, added};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(rms_norm_impl(x, c10::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, residual, weight, eps);
}

// ------------------------------------------------------------------------------------------------------- rotary
// One head: out[i] = r(r(x[i] * c[i]) + r(x[(i + h) % d] * s[i])), h = d / 2.
template <typename T>
void rotary_head(const T* x, const T* c, const T* s, T* out, int64_t d) {
  const int64_t h = d / 2;
#ifdef KILAT_AVX512
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = tail(h - i);
    const __m512 lo = vload(x + i, m), hi = vload(x + h + i, m);
    vstore(out + i, vrnd<T>(_mm512_add_ps(vrnd<T>(_mm512_mul_ps(lo, vload(c + i, m))),
                                          vrnd<T>(_mm512_mul_ps(hi, vload(s + i, m))))), m);
    vstore(out + h + i, vrnd<T>(_mm512_add_ps(vrnd<T>(_mm512_mul_ps(hi, vload(c + h + i, m))),
                                              vrnd<T>(_mm512_mul_ps(lo, vload(s + h + i, m))))), m);
  }
#else
#ifdef KILAT_AVX2
  if (h % 8 == 0) {
    for (int64_t i = 0; i < h; i += 8) {
      const __m256 lo = vload8(x + i), hi = vload8(x + h + i);
      vstore8(out + i, vrnd8<T>(_mm256_add_ps(vrnd8<T>(_mm256_mul_ps(lo, vload8(c + i))),
                                              vrnd8<T>(_mm256_mul_ps(hi, vload8(s + i))))));
      vstore8(out + h + i, vrnd8<T>(_mm256_add_ps(vrnd8<T>(_mm256_mul_ps(hi, vload8(c + h + i))),
                                                  vrnd8<T>(_mm256_mul_ps(lo, vload8(s + h + i))))));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < d; ++i) {
    const float a = rnd<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
    const float b = rnd<T>(static_cast<float>(x[(i + h) % d]) * static_cast<float>(s[i]));
    out[i] = static_cast<T>(a + b);
  }
#endif
}

// cos/sin [T, 1, D] or [T, D] in dtype with a contiguous last dimension (token t's row at stride(0) * t).
at::Tensor table_rows(const at::Tensor& t, int64_t tokens, int64_t d, at::ScalarType dtype) {
  TORCH_CHECK((t.dim() == 2 || (t.dim() == 3 && t.size(1) == 1)) && t.size(0) == tokens && t.size(-1) == d,
              "cos and sin must be [T, 1, D] or [T, D]");
  return with_dtype(t, dtype);
}

at::Tensor rotary(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 3, "x must be a CPU tensor [T, heads, D]");
  const int64_t tokens = x_in.size(0), heads = x_in.size(1), d = x_in.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  const at::Tensor x = with_dtype(x_in, x_in.scalar_type());
  const at::Tensor cos = table_rows(cos_in, tokens, d, x.scalar_type());
  const at::Tensor sin = table_rows(sin_in, tokens, d, x.scalar_type());
  at::Tensor out = at::empty({tokens, heads, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    const Rows<scalar_t> xr(x);
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    const int64_t cs = cos.stride(0), ss = sin.stride(0);
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens * heads, grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t t = r / heads;
        rotary_head<scalar_t>(xr[r], c + t * cs, s + t * ss, o + r * d, d);
      }
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------------------- SiLU-and-mul
template <typename T>
void silu_and_mul_row(const T* g, const T* u, T* out, int64_t n) {
#ifdef KILAT_AVX512
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail(n - i);
    const __m512 gv = vload(g + i, m);
    const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    vstore(out + i, vrnd<T>(_mm512_mul_ps(vrnd<T>(silu), vload(u + i, m))), m);
  }
#else
#ifdef KILAT_AVX2
  if (n % 8 == 0) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 gv = vload8(g + i);
      const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, vexp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      vstore8(out + i, vrnd8<T>(_mm256_mul_ps(vrnd8<T>(silu), vload8(u + i))));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float gv = static_cast<float>(g[i]);
    out[i] = static_cast<T>(rnd<T>(gv / (1.f + std::exp(-gv))) * static_cast<float>(u[i]));
  }
#endif
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() >= 1 && x_in.size(-1) % 2 == 0,
              "x must be a CPU tensor [..., 2I]");
  const int64_t n = x_in.size(-1) / 2;
  const at::Tensor x = as_rows(x_in.dim() == 2 ? x_in : x_in.reshape({-1, 2 * n}));
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = x.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row<scalar_t>(src + r * stride, src + r * stride + n, o + r * n, n);
    });
  });
  return out;
}

// Index of the first NaN of x[0, n) (a vector pass found one).
template <typename T>
int64_t first_nan(const T* x, int64_t n) {
  return std::find_if(x, x + n, [](T v) { return std::isnan(static_cast<float>(v)); }) - x;
}

#if defined(KILAT_AVX512) || defined(KILAT_AVX2)
// Of the lanes' best values and their first indices, the smallest index among the lanes holding the largest value
// (stored in `best`).
int64_t lanes_first_max(const float* bv, const int32_t* bi, int lanes, float& best) {
  best = bv[0];
  int64_t at = bi[0];
  for (int l = 1; l < lanes; ++l)
    if (bv[l] > best || (bv[l] == best && bi[l] < at)) best = bv[l], at = bi[l];
  return at;
}
#endif

// Index of the first maximum of x[0, n), or of the first NaN, comparing the values widened to float32 (exact for
// every T, so the order is x's own). Each lane keeps the first index of its largest value (a later value must be
// strictly greater to replace it); two sets of lanes take alternate chunks, and the lanes holding the overall
// maximum give it their smallest index.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
  int64_t at = 0;
#if defined(KILAT_AVX512)
  if (n >= 32) {
    __m512 b0 = _mm512_set1_ps(-INFINITY), b1 = b0;
    __m512i i0 = _mm512_setzero_si512(), i1 = i0;
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    const __mmask16 all = 0xFFFF;
    __mmask16 unordered = 0;
    for (; i + 32 <= n; i += 32) {
      const __m512 v0 = vload(x + i, all), v1 = vload(x + i + 16, all);
      const __mmask16 g0 = _mm512_cmp_ps_mask(v0, b0, _CMP_GT_OQ);
      const __m512i idx1 = _mm512_add_epi32(idx, step);
      const __mmask16 g1 = _mm512_cmp_ps_mask(v1, b1, _CMP_GT_OQ);
      unordered |= _mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q);
      b0 = _mm512_mask_mov_ps(b0, g0, v0);
      i0 = _mm512_mask_mov_epi32(i0, g0, idx);
      b1 = _mm512_mask_mov_ps(b1, g1, v1);
      i1 = _mm512_mask_mov_epi32(i1, g1, idx1);
      idx = _mm512_add_epi32(idx1, step);
    }
    if (unordered) return first_nan(x, n);
    alignas(64) float bv[32];
    alignas(64) int32_t bi[32];
    _mm512_store_ps(bv, b0);
    _mm512_store_ps(bv + 16, b1);
    _mm512_store_si512(bi, i0);
    _mm512_store_si512(bi + 16, i1);
    at = lanes_first_max(bv, bi, 32, best);
  }
#elif defined(KILAT_AVX2)
  if (n >= 16) {
    __m256 b0 = _mm256_set1_ps(-INFINITY), b1 = b0;
    __m256i i0 = _mm256_setzero_si256(), i1 = i0;
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    __m256 unordered = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m256 v0 = vload8(x + i), v1 = vload8(x + i + 8);
      const __m256 g0 = _mm256_cmp_ps(v0, b0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(v1, b1, _CMP_GT_OQ);
      const __m256i idx1 = _mm256_add_epi32(idx, step);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
      b0 = _mm256_blendv_ps(b0, v0, g0);
      i0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i0), _mm256_castsi256_ps(idx), g0));
      b1 = _mm256_blendv_ps(b1, v1, g1);
      i1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i1), _mm256_castsi256_ps(idx1), g1));
      idx = _mm256_add_epi32(idx1, step);
    }
    if (_mm256_movemask_ps(unordered)) return first_nan(x, n);
    alignas(32) float bv[16];
    alignas(32) int32_t bi[16];
    _mm256_store_ps(bv, b0);
    _mm256_store_ps(bv + 8, b1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bi), i0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bi + 8), i1);
    at = lanes_first_max(bv, bi, 16, best);
  }
#endif
  if (i == 0) {  // no vector pass: the first element leads
    best = static_cast<float>(x[0]);
    if (std::isnan(best)) return 0;
    i = 1;
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) best = v, at = i;
  }
  return at;
}

at::Tensor argmax(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 && supported(x_in.scalar_type()) && x_in.size(1) > 0 &&
                  x_in.size(1) < (int64_t{1} << 31),
              "x must be a float32, bfloat16 or float16 CPU tensor [B, V] with 0 < V < 2^31");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(src + r * stride, n);
    });
  });
  return out;
}

}  // namespace

KILAT_LIBRARY(kilat_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)", add_rms_norm);
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor", rotary);
  m.def("silu_and_mul(Tensor x) -> Tensor", silu_and_mul);
  m.def("argmax(Tensor x) -> Tensor", argmax);
}
