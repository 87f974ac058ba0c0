// Paged attention for CPU over a whole step: every new token of every request attends its context, read in place
// from the paged KV cache (no gather, no mask tensors). The torch path this replaces is paged_attention in
// kilat/model_executor/attention/torch_ref.py (gather + SDPA), which stays the oracle and the fallback.
//
// Decodes (requests with one new token): one work item per (decode, KV head); its g = num_heads / num_kv_heads
// query heads are computed together, so each key and value row is read (and converted to float32) once per item.
// When the items share out badly over the threads (e.g. one decode's 3 KV heads on 2 threads) and the context is
// long enough, each item's keys are split across threads (flash-decoding, see num_splits) and the partial results
// merged by their log-sum-exp.
// Extends (requests with several new tokens: prefill chunks, over a cached prefix or not, verification spans): spans
// of tokens of one request and KV head (run_extends), each row seeing only the keys its token does (causal, sliding
// window); spans too few for the threads have their keys split as the decodes' are.
// Keys go in tiles of kTile with an online softmax (FlashAttention-2, Dao 2023): scores, softmax and the weighted V
// sum in float32, the output rounded once to the query dtype. AVX-512 (or AVX2 with FMA and F16C) for the row
// conversions, dot products, exponentials and V sums where compiled in, portable loops otherwise (same arithmetic up
// to summation order and the exponential's last bit).
//
// Op (namespace kilat_cpu_attn_<isa>): paged_attention(query [T, H, hd], kv_cache [2, blocks, block_size, KVH, hd],
// kv_scales [2, blocks, block_size, KVH]?, block_table int32 [R, nb], seq_lens int32 [R], query_start_loc int32
// [R + 1], scale, sliding_window, logits_soft_cap, sinks [H]?) -> [T, H, hd] in the query dtype (AttentionMetadata's tensors, see
// kilat/model_executor/attention/metadata.py). query may be a strided view (last dimension contiguous); kv_cache
// contiguous, of the query's dtype (float32, bfloat16 or float16), or int8 / fp8 (e4m3, e5m2) with float32
// kv_scales (kilat/model_executor/attention/kv_cache.py). Request r's new tokens are query rows
// query_start_loc[r] .. query_start_loc[r + 1] - 1, at the last positions of its seq_lens[r]; the token at position p
// sees keys j with p - sliding_window < j <= p (sliding_window <= 0: all j <= p). With logits_soft_cap c > 0 each score
// s (scale times q.k) becomes c tanh(s / c) before the mask and the softmax (Gemma 2's attention logit soft-capping).
// With float32 sinks, head h's sink logit joins its softmax's denominator and carries no value (GPT-OSS's attention
// sinks): out = sum_j e^(s_j) v_j / (e^(sinks[h]) + sum_j e^(s_j)), added once where the partial states are merged.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kilat_library.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#define KILAT_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define KILAT_BF16DP 1  // bfloat16 extends: query x key products with vdpbf16ps (attend_tile_bf16)
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KILAT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 16;             // keys per online-softmax step
constexpr int64_t kSplitMinChunk = 64;    // keys per split of the longest context, at least (see num_splits)
constexpr int64_t kExtendRows = 96;       // query rows (tokens x query heads of a KV head) per extend span, at most

// ------------------------------------------------------------------------------------- float32 vector helpers
#ifdef KILAT_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
#ifdef KILAT_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

// dst[0:n] = float(src[0:n])
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(KILAT_AVX512)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#elif defined(KILAT_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef KILAT_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(KILAT_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#ifdef KILAT_AVX2
// s[0:4] = the horizontal sums of acc[0:4], in one hadd tree.
inline void store_sums4(const __m256 acc[4], float* s) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
#endif

// s[j] = dot(q, k + j * dim, dim) for j < n. On AVX2, four keys at a time: four independent FMA chains, their
// horizontal sums in one hadd tree (the same products, summed in another order than dot's).
inline void dots(const float* q, const float* k, int64_t n, int64_t dim, float* s) {
  int64_t j = 0;
#ifdef KILAT_AVX2
  if (dim % 8 == 0) {
    for (; j + 4 <= n; j += 4) {
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t i = 0; i < dim; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + r) * dim + i), acc[r]);
      }
      store_sums4(acc, s + j);
    }
  }
#endif
  for (; j < n; ++j) s[j] = dot(q, k + j * dim, dim);
}

// y[0:n] += a * x[0:n]
inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef KILAT_AVX512
  const __m512 av = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(KILAT_AVX2)
  const __m256 av = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

// y[0:n] *= c
inline void scale(float c, float* y, int64_t n) {
  int64_t i = 0;
#ifdef KILAT_AVX512
  const __m512 cv = _mm512_set1_ps(c);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(cv, _mm512_loadu_ps(y + i)));
#elif defined(KILAT_AVX2)
  const __m256 cv = _mm256_set1_ps(c);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(cv, _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] *= c;
}

// acc[0:dim] += sum_j p[j] * v[j * dim : (j + 1) * dim] over j < n (each 16 lanes of acc stay in a register)
inline void weighted_sum(const float* p, const float* v, int64_t n, int64_t dim, float* acc) {
  int64_t i = 0;
#ifdef KILAT_AVX512
  for (; i + 16 <= dim; i += 16) {
    __m512 a = _mm512_loadu_ps(acc + i);
    for (int64_t j = 0; j < n; ++j) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(v + j * dim + i), a);
    _mm512_storeu_ps(acc + i, a);
  }
#elif defined(KILAT_AVX2)
  for (; i + 32 <= dim; i += 32) {  // 4 independent FMA chains (one chain per 8 lanes is latency-bound on AVX2 CPUs)
    __m256 a[4];
    for (int c = 0; c < 4; ++c) a[c] = _mm256_loadu_ps(acc + i + 8 * c);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int c = 0; c < 4; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * dim + i + 8 * c), a[c]);
    }
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + i + 8 * c, a[c]);
  }
  for (; i + 8 <= dim; i += 8) {
    __m256 a = _mm256_loadu_ps(acc + i);
    for (int64_t j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + j * dim + i), a);
    _mm256_storeu_ps(acc + i, a);
  }
#endif
  for (; i < dim; ++i)
    for (int64_t j = 0; j < n; ++j) acc[i] += p[j] * v[j * dim + i];
}

#ifdef KILAT_AVX512
// e^x for x <= 0 to about 1 ulp (Cephes expf): x = k ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 polynomial, 2^k
// by scalef. x below -88 gives 2^-127-ish, not 0: callers mask lanes that must be 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, k);
}
#endif
#ifdef KILAT_AVX2
// exp16 on 8 lanes; 2^k built in the exponent field, so x near -88 (k = -127) gives 0 instead of 2^-127-ish.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(two_k));
}
#endif

// One online-softmax step over n <= 16 scores s: m becomes max(m, s), s becomes e^(s - m) (the weights), l becomes
// l e^(m_old - m) + sum of the weights; returns e^(m_old - m), the factor for the output so far.
inline float softmax_step(float* s, int64_t n, float& m, float& l) {
  const float m_old = m;
  float sum = 0.f;
#ifdef KILAT_AVX512
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, s);
  m = std::max(m, _mm512_reduce_max_ps(x));
  const __m512 w = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, _mm512_set1_ps(m))));
  _mm512_mask_storeu_ps(s, live, w);
  sum = _mm512_reduce_add_ps(w);
#elif defined(KILAT_AVX2)
  alignas(32) float t[16];
  for (int64_t j = 0; j < 16; ++j) t[j] = j < n ? s[j] : -std::numeric_limits<float>::infinity();
  m = std::max(m, hmax8(_mm256_max_ps(_mm256_load_ps(t), _mm256_load_ps(t + 8))));
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sums = _mm256_setzero_ps();
  for (int64_t h = 0; h < 16; h += 8) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 live = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(static_cast<float>(h))),
                                      _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
    const __m256 w = _mm256_and_ps(live, exp8(_mm256_sub_ps(_mm256_load_ps(t + h), mv)));
    _mm256_store_ps(t + h, w);
    sums = _mm256_add_ps(sums, w);
  }
  for (int64_t j = 0; j < n; ++j) s[j] = t[j];
  sum = hsum8(sums);
#else
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - m));
#endif
  const float correction = std::exp(m_old - m);  // 0 on the first step (m_old = -inf)
  l = l * correction + sum;
  return correction;
}

// ------------------------------------------------------------------------------------------------- the problem
enum class Storage { model, int8, e4m3, e5m2 };  // how the cache holds keys and values (model = the query dtype)

// float32 value of each fp8 byte.
template <typename F8>
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(F8(static_cast<uint8_t>(b), F8::from_bits()));
    return t;
  }();
  return table.data();
}

struct Problem {
  int64_t reqs, heads, kv_heads, group, dim, block_size, table_stride;
  int64_t values;                // offset of the values plane in the cache (elements)
  int64_t q_stride0, q_stride1;  // query strides (elements) of dimensions 0 and 1
  const int32_t* block_table;    // [reqs, table_stride]
  const int32_t* seq_lens;       // [reqs]
  const int32_t* q_start;        // [reqs + 1]
  float scale;
  int64_t window;
  float soft_cap = 0.f;  // attention logit soft-capping (> 0), or 0 for none
  const float* sinks = nullptr;  // [heads] attention-sink logits, or none
  Storage storage = Storage::model;
  const float* kv_scales = nullptr;  // [2, blocks, block_size, kv_heads] for a quantized cache
  int64_t scale_values = 0;          // offset of the values' scales

  int64_t query_len(int64_t r) const { return q_start[r + 1] - q_start[r]; }
  int64_t context_len(int64_t r) const { return seq_lens[r] - query_len(r); }

  // First key that the token at position pos sees.
  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }

  // Offset (elements) of the key row at position pos of request r's KV head h; its value row is `values` further.
  int64_t key_row(int64_t r, int64_t h, int64_t pos) const {
    const int64_t block = block_table[r * table_stride + pos / block_size];
    return ((block * block_size + pos % block_size) * kv_heads + h) * dim;
  }
};

// s[0:n] = c tanh(s / c) with c = p.soft_cap (attention logit soft-capping), when it is set: on a tile's scores,
// before the mask. Scalar tanh: a soft-capped model pays it per score, the others one branch per tile row.
inline void soft_cap(const Problem& p, float* s, int64_t n) {
  if (p.soft_cap <= 0.f) return;
  const float c = p.soft_cap, inv = 1.f / p.soft_cap;
  for (int64_t j = 0; j < n; ++j) s[j] = c * std::tanh(s[j] * inv);
}

// dst[0:dim] = the key (value = false) or value row at element offset `row` as float32: converted, or dequantized
// as the torch backend does (kilat/model_executor/attention/kv_cache.py, dequantize_kv): stored value times the
// row's scale, both rounded to the model dtype T and the product too.
template <typename T>
void load_row(const Problem& p, const void* cache, int64_t row, bool value, float* dst) {
  const int64_t at = row + (value ? p.values : 0);
  if (p.storage == Storage::model) return to_float(static_cast<const T*>(cache) + at, dst, p.dim);
  const float s = static_cast<float>(static_cast<T>(p.kv_scales[(value ? p.scale_values : 0) + row / p.dim]));
  const float* table = p.storage == Storage::e4m3 ? fp8_table<c10::Float8_e4m3fn>()
                                                  : p.storage == Storage::e5m2 ? fp8_table<c10::Float8_e5m2>() : nullptr;
  const int8_t* q = static_cast<const int8_t*>(cache) + at;
  for (int64_t i = 0; i < p.dim; ++i) {
    const float x = table ? table[static_cast<uint8_t>(q[i])] : static_cast<float>(q[i]);
    dst[i] = static_cast<float>(static_cast<T>(x * s));
  }
}

// Tokens [t0, t1) of request r's new tokens with the query heads of KV head h: (t1 - t0) * group query rows, row
// i = (token t0 + i / group, query head h * group + i % group). A decode is one token.
struct Span {
  int64_t r, h, t0, t1;
  int64_t rows(const Problem& p) const { return (t1 - t0) * p.group; }
};

// Softmax state of a span's rows over some keys, float32 [rows * (dim + 2)]: running maxima m [rows], sums of
// exponentials l [rows], the unnormalised outputs acc [rows, dim]. A row that saw no key has m = -inf, l = 0, acc = 0.
struct State {
  int64_t rows;
  float* m;
  float* l;
  float* acc;
  State(float* base, int64_t rows) : rows(rows), m(base), l(base + rows), acc(base + 2 * rows) {}
  static int64_t size(const Problem& p, int64_t rows) { return rows * (p.dim + 2); }

  // Back to the state that saw no key.
  void reset(const Problem& p) {
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.f);
    std::fill(acc, acc + rows * p.dim, 0.f);
  }
};

// Per-thread scratch for spans of up to `rows` rows: their queries (float32, times scale), one tile's keys (as rows
// and transposed), values and scores, an output row, and (extend spans) a state.
struct Scratch {
  std::vector<float> q, k, kt, v, s, row, state;
  std::vector<int32_t> qt;  // attend_tile_bf16: the span's queries transposed, bfloat16 pairs
  std::vector<float> ot, mrow, lrow;  // attend_tile_bf16: its outputs transposed, running maxima and sums
  Scratch(const Problem& p, int64_t rows)
      : q(rows * p.dim), k(kTile * p.dim), kt(kTile * p.dim), v(kTile * p.dim), s(rows * kTile), row(p.dim),
        state(State::size(p, rows)) {}
};

template <typename T>
void load_queries(const Problem& p, const T* query, const Span& sp, Scratch& sc) {
  for (int64_t i = 0; i < sp.rows(p); ++i) {
    float* q = &sc.q[i * p.dim];
    to_float(query + (p.q_start[sp.r] + sp.t0 + i / p.group) * p.q_stride0 + (sp.h * p.group + i % p.group) * p.q_stride1,
             q, p.dim);
    scale(p.scale, q, p.dim);
  }
}

// Attend keys [begin, end) of span sp into `st` (which starts empty), each row only the keys its token sees (causal,
// sliding window); queries already in sc.q. Each key and value row is read and converted once per tile for all rows.
template <typename T>
void attend(const Problem& p, const void* cache, const Span& sp, int64_t begin, int64_t end, Scratch& sc, State st) {
  const int64_t dim = p.dim, rows = sp.rows(p), ctx = p.context_len(sp.r);
  // Keys every row sees: from the last token's first key to the first token's position.
  const int64_t all_from = p.first_key(ctx + sp.t1 - 1), all_to = ctx + sp.t0;
  st.reset(p);
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t row = p.key_row(sp.r, sp.h, t0 + j);
      load_row<T>(p, cache, row, false, &sc.k[j * dim]);
      load_row<T>(p, cache, row, true, &sc.v[j * dim]);
    }
    const bool whole = t0 >= all_from && t0 + n - 1 <= all_to;
    for (int64_t i = 0; i < rows; ++i) {
      float* s = &sc.s[i * kTile];
      dots(&sc.q[i * dim], sc.k.data(), n, dim, s);
      soft_cap(p, s, n);
      if (!whole) {  // keys of this tile the row's token does not see get weight 0
        const int64_t pos = ctx + sp.t0 + i / p.group, lo = p.first_key(pos) - t0, hi = pos - t0;
        if (lo > hi || lo >= n || hi < 0) {
          std::fill(s, s + n, 0.f);
          continue;
        }
        for (int64_t j = 0; j < n; ++j)
          if (j < lo || j > hi) s[j] = -std::numeric_limits<float>::infinity();
      }
      float* acc = &st.acc[i * dim];
      scale(softmax_step(s, n, st.m[i], st.l[i]), acc, dim);
    }
    for (int64_t i = 0; i < rows; ++i) weighted_sum(&sc.s[i * kTile], sc.v.data(), n, dim, &st.acc[i * dim]);
  }
}

#ifdef KILAT_AVX512
// The 4 horizontal sums of acc[0:4] into s[0:4]: pairs of lanes summed within each 128-bit block (unpack, shuffle),
// then the four blocks summed.
inline void store_sums4(const __m512 acc[4], float* s) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

#if defined(KILAT_AVX512) || defined(KILAT_AVX2)
// kW float32 lanes per vector, on AVX-512 or AVX2.
#ifdef KILAT_AVX512
using Vec = __m512;
constexpr int kW = 16;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
template <typename T>
inline Vec vload_row(const T* p) { return load16(p); }  // kW values of a cache row as float32
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int kW = 8;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
template <typename T>
inline Vec vload_row(const T* p) { return load8(p); }
inline float vsum(Vec v) { return hsum8(v); }
#endif

// Prefetch the key and value rows of keys [from, to) of span sp (a KV head's rows are strided in the cache, which
// the hardware prefetchers follow slowly: see attend_rows).
template <typename T>
inline void prefetch_rows(const Problem& p, const T* cache, const Span& sp, int64_t from, int64_t to) {
  for (int64_t j = from; j < to; ++j) {
    const T* row = cache + p.key_row(sp.r, sp.h, j);
    const char* k = reinterpret_cast<const char*>(row);
    const char* v = reinterpret_cast<const char*>(row + p.values);
    for (int64_t b = 0; b < p.dim * static_cast<int64_t>(sizeof(T)); b += 64) {
      _mm_prefetch(k + b, _MM_HINT_T0);
      _mm_prefetch(v + b, _MM_HINT_T0);
    }
  }
}

// attend() for a decode (one token, which sees every key of [begin, end)) with G query heads per KV head (G <= 4 on
// AVX-512, <= 3 on AVX2's 16 registers), head_dim a multiple of 16 and the cache in the model dtype, without attend's
// float32 copies of each tile's K and V rows (on AVX2 CPUs those conversions and stores took about half the time):
// each kW values of a key or value row are converted once, in a register, and used for all G heads. Scores of 4 keys
// x G heads in 4G independent FMA chains, each head's 4 sums in one shuffle tree; the V sums as attend's (per lane,
// key by key), 16 lanes at a time; the next tile's rows prefetched (a KV head's rows are strided in the cache, which
// the hardware prefetchers followed at 14 GB/s on Zen 5: 16 decodes of 264 keys, 30 layers, 3.1x faster with it).
// Not inlined: its registers then do not depend on the caller's loop (inlined in run's, it measured 1% slower).
template <typename T, int G>
__attribute__((noinline)) void attend_rows(const Problem& p, const T* cache, const Span& sp, int64_t begin,
                                           int64_t end, Scratch& sc, State st) {
  constexpr int C = 16 / kW;  // vectors per 16 lanes of a V row
  const int64_t dim = p.dim;
  st.reset(p);
  const T* krow[kTile];
  const T* vrow[kTile];
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    for (int64_t j = 0; j < n; ++j) {
      krow[j] = cache + p.key_row(sp.r, sp.h, t0 + j);
      vrow[j] = krow[j] + p.values;
    }
    prefetch_rows(p, cache, sp, t0 + kTile, std::min(end, t0 + 2 * kTile));
    float* s = sc.s.data();  // [G, kTile]
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      Vec acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < 4; ++r) acc[g][r] = vzero();
      for (int64_t i = 0; i < dim; i += kW)
        for (int r = 0; r < 4; ++r) {
          const Vec kv = vload_row(krow[j + r] + i);
          for (int g = 0; g < G; ++g) acc[g][r] = vfma(vload(&sc.q[g * dim + i]), kv, acc[g][r]);
        }
      for (int g = 0; g < G; ++g) store_sums4(acc[g], s + g * kTile + j);
    }
    for (; j < n; ++j) {
      Vec acc[G];
      for (int g = 0; g < G; ++g) acc[g] = vzero();
      for (int64_t i = 0; i < dim; i += kW) {
        const Vec kv = vload_row(krow[j] + i);
        for (int g = 0; g < G; ++g) acc[g] = vfma(vload(&sc.q[g * dim + i]), kv, acc[g]);
      }
      for (int g = 0; g < G; ++g) s[g * kTile + j] = vsum(acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      soft_cap(p, s + g * kTile, n);
      scale(softmax_step(s + g * kTile, n, st.m[g], st.l[g]), &st.acc[g * dim], dim);
    }
    for (int64_t i = 0; i < dim; i += 16) {
      Vec a[G][C];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) a[g][c] = vload(&st.acc[g * dim + i + kW * c]);
      for (int64_t jj = 0; jj < n; ++jj) {
        Vec v[C];
        for (int c = 0; c < C; ++c) v[c] = vload_row(vrow[jj] + i + kW * c);
        for (int g = 0; g < G; ++g) {
          const Vec pj = vset1(s[g * kTile + jj]);
          for (int c = 0; c < C; ++c) a[g][c] = vfma(pj, v[c], a[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) vstore(&st.acc[g * dim + i + kW * c], a[g][c]);
    }
  }
}
#endif

// A decode's keys [begin, end): attend_rows where it applies (AVX-512 with G <= 4 or AVX2 with G <= 3, head_dim a
// multiple of 16, the cache in the model dtype), else attend.
template <typename T>
void attend_decode(const Problem& p, const void* cache, const Span& sp, int64_t begin, int64_t end, Scratch& sc,
                   State st) {
#if defined(KILAT_AVX512) || defined(KILAT_AVX2)
  if (p.dim % 16 == 0 && p.storage == Storage::model) {
    const T* c = static_cast<const T*>(cache);
    if (p.group == 1) return attend_rows<T, 1>(p, c, sp, begin, end, sc, st);
    if (p.group == 2) return attend_rows<T, 2>(p, c, sp, begin, end, sc, st);
    if (p.group == 3) return attend_rows<T, 3>(p, c, sp, begin, end, sc, st);
#ifdef KILAT_AVX512
    if (p.group == 4) return attend_rows<T, 4>(p, c, sp, begin, end, sc, st);
#endif
  }
#endif
  attend<T>(p, cache, sp, begin, end, sc, st);
}

#if defined(KILAT_AVX512) || defined(KILAT_AVX2)
constexpr int kKeyVecs = kTile / kW;  // vectors per row of a tile's scores
constexpr int kRowBlock = kW / 2;     // rows whose scores are computed together: 8 independent FMA chains

// acc[0:C kW] = acc * correction + sum_j p[j] v[j * dim : j * dim + C kW] over j < n, in C registers; returns C kW.
template <int C>
inline int64_t weigh_values(const float* p, const float* v, int64_t n, int64_t dim, float correction, float* acc) {
  const Vec cv = vset1(correction);
  Vec a[C];
  for (int c = 0; c < C; ++c) a[c] = vmul(cv, vload(acc + c * kW));
  for (int64_t j = 0; j < n; ++j) {
    const Vec pj = vset1(p[j]);
    for (int c = 0; c < C; ++c) a[c] = vfma(pj, vload(v + j * dim + c * kW), a[c]);
  }
  for (int c = 0; c < C; ++c) vstore(acc + c * kW, a[c]);
  return C * kW;
}

// attend() for an extend span (several rows) with head_dim a multiple of kW, as a small matrix product per tile of
// kTile keys: the tile's keys are converted and transposed once into kt [dim, kTile], so that kRowBlock rows' scores
// come out as whole vectors (a broadcast query value times a row of kt, no horizontal sums); each row's weighted V
// sum keeps up to 8 vectors of its output in registers, rescaled by the softmax correction on the way in.
template <typename T>
__attribute__((noinline)) void attend_tile(const Problem& p, const void* cache, const Span& sp, int64_t begin,
                                           int64_t end, Scratch& sc, State st) {
  const int64_t dim = p.dim, rows = sp.rows(p), ctx = p.context_len(sp.r);
  const int64_t all_from = p.first_key(ctx + sp.t1 - 1), all_to = ctx + sp.t0;
  float* kt = sc.kt.data();
  st.reset(p);
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t row = p.key_row(sp.r, sp.h, t0 + j);
      load_row<T>(p, cache, row, false, sc.k.data());
      for (int64_t d = 0; d < dim; ++d) kt[d * kTile + j] = sc.k[d];
      load_row<T>(p, cache, row, true, &sc.v[j * dim]);
    }
    for (int64_t i0 = 0; i0 < rows; i0 += kRowBlock) {  // scores s[i, 0:kTile] = q[i] . kt
      const int64_t rb = std::min<int64_t>(kRowBlock, rows - i0);
      Vec acc[kRowBlock][kKeyVecs];
      for (int r = 0; r < kRowBlock; ++r)
        for (int c = 0; c < kKeyVecs; ++c) acc[r][c] = vzero();
      const float* q = &sc.q[i0 * dim];
      if (rb == kRowBlock) {
        for (int64_t d = 0; d < dim; ++d)
          for (int r = 0; r < kRowBlock; ++r) {
            const Vec qv = vset1(q[r * dim + d]);
            for (int c = 0; c < kKeyVecs; ++c) acc[r][c] = vfma(qv, vload(kt + d * kTile + c * kW), acc[r][c]);
          }
      } else {
        for (int64_t d = 0; d < dim; ++d)
          for (int64_t r = 0; r < rb; ++r) {
            const Vec qv = vset1(q[r * dim + d]);
            for (int c = 0; c < kKeyVecs; ++c) acc[r][c] = vfma(qv, vload(kt + d * kTile + c * kW), acc[r][c]);
          }
      }
      for (int64_t r = 0; r < rb; ++r)
        for (int c = 0; c < kKeyVecs; ++c) vstore(&sc.s[(i0 + r) * kTile + c * kW], acc[r][c]);
    }
    const bool whole = t0 >= all_from && t0 + n - 1 <= all_to;
    for (int64_t i = 0; i < rows; ++i) {
      float* s = &sc.s[i * kTile];
      soft_cap(p, s, n);
      float correction = 1.f;
      bool none = false;
      if (!whole) {  // keys of this tile the row's token does not see get weight 0
        const int64_t pos = ctx + sp.t0 + i / p.group, lo = p.first_key(pos) - t0, hi = pos - t0;
        none = lo >= n || hi < 0;
        for (int64_t j = 0; j < n; ++j)
          if (none || j < lo || j > hi) s[j] = -std::numeric_limits<float>::infinity();
      }
      if (none)
        std::fill(s, s + n, 0.f);
      else
        correction = softmax_step(s, n, st.m[i], st.l[i]);
      float* acc = &st.acc[i * dim];
      int64_t c0 = 0;
      for (; c0 + 8 * kW <= dim; c0 += 8 * kW) weigh_values<8>(s, sc.v.data() + c0, n, dim, correction, acc + c0);
      if (c0 + 4 * kW <= dim) c0 += weigh_values<4>(s, sc.v.data() + c0, n, dim, correction, acc + c0);
      if (c0 + 2 * kW <= dim) c0 += weigh_values<2>(s, sc.v.data() + c0, n, dim, correction, acc + c0);
      if (c0 < dim) weigh_values<1>(s, sc.v.data() + c0, n, dim, correction, acc + c0);
    }
  }
}
#endif

#ifdef KILAT_BF16DP
// attend_tile for a bfloat16 query and cache without soft-capping, with the span's rows in the vector lanes: the
// queries are transposed once per span into bfloat16 pairs (qt[g][d / 2] = lanes i: q[16 g + i][d], q[16 g + i][d + 1],
// exact), so each key's scores for 16 rows come from dim / 2 vdpbf16ps with the key's own pairs broadcast from the
// cache (no transposition of K; each product exact, summed in float32), then times scale. The online softmax runs
// on 16 rows at once, and the weighted V sum in float32 FMAs, out^T[d] (16 rows) += V[j][d] p_j, each value
// broadcast from its row converted to float32 once per tile. ~2x attend_tile's speed on Zen 5 (docs/benchmarks.md).
__attribute__((noinline)) void attend_tile_bf16(const Problem& p, const c10::BFloat16* query, const c10::BFloat16* cache,
                                                const Span& sp, int64_t begin, int64_t end, Scratch& sc, State st) {
  const int64_t dim = p.dim, rows = sp.rows(p), ctx = p.context_len(sp.r), pairs = dim / 2;
  const int64_t groups = (rows + 15) / 16;
  sc.qt.assign(groups * pairs * 16, 0);
  sc.ot.assign(groups * dim * 16, 0.f);
  sc.mrow.assign(groups * 16, -std::numeric_limits<float>::infinity());
  sc.lrow.assign(groups * 16, 0.f);
  for (int64_t i = 0; i < rows; ++i) {
    const c10::BFloat16* q = query + (p.q_start[sp.r] + sp.t0 + i / p.group) * p.q_stride0 +
                             (sp.h * p.group + i % p.group) * p.q_stride1;
    for (int64_t d = 0; d < pairs; ++d) std::memcpy(&sc.qt[((i / 16) * pairs + d) * 16 + i % 16], q + 2 * d, 4);
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), scale = _mm512_set1_ps(p.scale);
  const int32_t* krow[kTile];
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    for (int64_t j = 0; j < kTile; ++j) {  // keys past n read key n - 1 again (their scores are masked)
      const int64_t row = p.key_row(sp.r, sp.h, t0 + std::min(j, n - 1));
      krow[j] = reinterpret_cast<const int32_t*>(cache + row);
      if (j < n) to_float(cache + row + p.values, &sc.v[j * dim], dim);
    }
    prefetch_rows(p, cache, sp, t0 + kTile, std::min(end, t0 + 2 * kTile));
    for (int64_t g = 0; g < groups; ++g) {
      __m512 s[kTile];
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) s[j] = _mm512_setzero_ps();
      const int32_t* qt = &sc.qt[g * pairs * 16];
      for (int64_t d = 0; d < pairs; ++d) {
        const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qt + d * 16));
#pragma GCC unroll 16
        for (int j = 0; j < kTile; ++j)
          s[j] = _mm512_dpbf16_ps(s[j], qv, reinterpret_cast<__m512bh>(_mm512_set1_epi32(krow[j][d])));
      }
      // lane i is row 16 g + i: token position pos_i, first key it sees first_i (rows past the span: masked anyway)
      alignas(64) int32_t pos[16], first[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t at = ctx + sp.t0 + std::min<int64_t>(16 * g + i, rows - 1) / p.group;
        pos[i] = static_cast<int32_t>(at);
        first[i] = static_cast<int32_t>(p.first_key(at));
      }
      const __m512i posv = _mm512_load_si512(pos), firstv = _mm512_load_si512(first);
      __mmask16 seen[kTile];
      const __m512 m_old = _mm512_loadu_ps(&sc.mrow[g * 16]);
      __m512 m = m_old;
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) {
        const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(t0 + j));
        seen[j] = j < n ? _mm512_cmple_epi32_mask(key, posv) & _mm512_cmpge_epi32_mask(key, firstv) : 0;
        s[j] = _mm512_mask_mul_ps(neg_inf, seen[j], s[j], scale);
        m = _mm512_max_ps(m, s[j]);
      }
      // a row that has seen no key yet keeps m = -inf; its exponents are taken against 0 (all masked to 0 anyway)
      const __m512 base = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(m, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
      const __m512 correction = exp16(_mm512_sub_ps(m_old, base));  // m_old = -inf: ~2^-127 times l = 0, acc = 0
      __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int j = 0; j < kTile; ++j) {
        s[j] = _mm512_maskz_mov_ps(seen[j], exp16(_mm512_sub_ps(s[j], base)));
        sum = _mm512_add_ps(sum, s[j]);
      }
      _mm512_storeu_ps(&sc.mrow[g * 16], m);
      _mm512_storeu_ps(&sc.lrow[g * 16], _mm512_fmadd_ps(_mm512_loadu_ps(&sc.lrow[g * 16]), correction, sum));
      float* ot = &sc.ot[g * dim * 16];
      for (int64_t d = 0; d < dim; ++d) {
        __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ot + d * 16), correction);
        for (int64_t j = 0; j < n; ++j) o = _mm512_fmadd_ps(_mm512_set1_ps(sc.v[j * dim + d]), s[j], o);
        _mm512_storeu_ps(ot + d * 16, o);
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t g = i / 16, lane = i % 16;
    st.m[i] = sc.mrow[i];
    st.l[i] = sc.lrow[i];
    for (int64_t d = 0; d < dim; ++d) st.acc[i * dim + d] = sc.ot[(g * dim + d) * 16 + lane];
  }
}
#endif

// Whether extends take attend_tile_bf16 (which reads the queries itself, not load_queries' float32 copies).
template <typename T>
bool extends_in_bf16(const Problem& p) {
#ifdef KILAT_BF16DP
  return std::is_same_v<T, c10::BFloat16> && p.dim % 16 == 0 && p.storage == Storage::model && p.soft_cap <= 0.f;
#else
  return false;
#endif
}

// An extend span's keys [begin, end): attend_tile_bf16 or attend_tile where they apply (AVX-512 or AVX2, head_dim a
// multiple of the vector width), else attend.
template <typename T>
void attend_extend(const Problem& p, const T* query, const void* cache, const Span& sp, int64_t begin, int64_t end,
                   Scratch& sc, State st) {
#ifdef KILAT_BF16DP
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (extends_in_bf16<T>(p)) return attend_tile_bf16(p, query, static_cast<const T*>(cache), sp, begin, end, sc, st);
#endif
#if defined(KILAT_AVX512) || defined(KILAT_AVX2)
  if (p.dim % kW == 0) return attend_tile<T>(p, cache, sp, begin, end, sc, st);
#endif
  attend<T>(p, cache, sp, begin, end, sc, st);
}

// Output rows of span sp from its `n_parts` states (consecutive, from `parts`), merged by log-sum-exp:
// sum_s acc_s e^(m_s - M) / (e^(sink - M) + sum_s l_s e^(m_s - M)) with M = max(sink, max_s m_s) (no sink term
// without p.sinks). Zeros for a row no state saw a key for.
template <typename T>
void finish(const Problem& p, float* parts, int64_t n_parts, const Span& sp, T* out, float* row) {
  const float none = -std::numeric_limits<float>::infinity();
  const int64_t rows = sp.rows(p), size = State::size(p, rows);
  for (int64_t i = 0; i < rows; ++i) {
    float big = none;
    for (int64_t s = 0; s < n_parts; ++s) big = std::max(big, State(parts + s * size, rows).m[i]);
    std::fill(row, row + p.dim, 0.f);
    if (big != none) {
      float total = 0.f;
      if (p.sinks != nullptr) {
        const float sink = p.sinks[sp.h * p.group + i % p.group];
        if (sink > big) {  // keep every exponent <= 0
          big = sink;
          total = 1.f;
        } else {
          total = std::exp(sink - big);
        }
      }
      for (int64_t s = 0; s < n_parts; ++s) {
        const State st(parts + s * size, rows);
        const float w = std::exp(st.m[i] - big);
        total += st.l[i] * w;
        axpy(w, &st.acc[i * p.dim], row, p.dim);
      }
      scale(1.f / total, row, p.dim);
    }
    T* o = out + ((p.q_start[sp.r] + sp.t0 + i / p.group) * p.heads + sp.h * p.group + i % p.group) * p.dim;
    for (int64_t j = 0; j < p.dim; ++j) o[j] = static_cast<T>(row[j]);
  }
}

// Splits per work item: `items` items (decodes' KV heads, or extend spans), each of at most `longest` keys. Tasks go to
// threads in contiguous runs of ceil(tasks / threads), so unsplit items take ceil(items / threads) item-times: 3 items
// on 2 threads take 2, one thread idle half of it. Splitting each item's keys in s parts takes ceil(items * s /
// threads) / s (1.5 for 3 items in halves). Take the smallest s <= threads that minimises it, with parts of the
// longest at least kSplitMinChunk keys, and only when it saves more than 1/20: splitting costs about that much
// (partial tiles, merges; and a thread left alone runs faster than two together). On 2 threads, 15 and 21 decode
// items in halves gain 1/16 and 1/22 in theory, measured about 2% and -1%; 3 items, 1/4 and 15%.
int64_t num_splits(int64_t items, int64_t longest) {
  const int64_t threads = at::get_num_threads();
  const auto units = [&](int64_t s) { return (items * s + threads - 1) / threads; };  // wall time, in 1/s items
  int64_t best = 1;
  for (int64_t s = 2; s <= std::min(threads, longest / kSplitMinChunk); ++s)
    if (units(s) * best < units(best) * s) best = s;
  return 20 * units(best) < 19 * units(1) * best ? best : 1;
}

// Keys [lo, hi) of part `split` of `splits` of keys [begin, end): equal parts, the last ones shorter or empty.
inline std::pair<int64_t, int64_t> split_keys(int64_t begin, int64_t end, int64_t splits, int64_t split) {
  const int64_t chunk = (end - begin + splits - 1) / splits;
  const int64_t lo = std::min(end, begin + split * chunk);
  return {lo, std::min(end, lo + chunk)};
}

// The decodes (requests with one new token): items (decode, KV head), each split in num_splits parts; the tasks
// (item, split) in one parallel region. An item's output is written by the task that finishes its last split (a
// counter per item; acq_rel so that task sees the other splits' states), not in a second region.
template <typename T>
void run_decodes(const Problem& p, const std::vector<int64_t>& decodes, const T* query, const void* cache, T* out) {
  const int64_t items = static_cast<int64_t>(decodes.size()) * p.kv_heads;
  int64_t longest = 0;
  for (const int64_t r : decodes) longest = std::max<int64_t>(longest, p.seq_lens[r] - p.first_key(p.seq_lens[r] - 1));
  const int64_t splits = num_splits(items, longest);
  const int64_t size = State::size(p, p.group);
  std::vector<float> states(items * splits * size);
  std::vector<std::atomic<int64_t>> done(splits > 1 ? items : 0);  // value-initialised: 0
  at::parallel_for(0, items * splits, 1, [&](int64_t first, int64_t last) {
    Scratch sc(p, p.group);
    for (int64_t task = first; task < last; ++task) {
      const int64_t item = task / splits, split = task % splits;
      const Span sp{decodes[item / p.kv_heads], item % p.kv_heads, 0, 1};
      const int64_t end = p.seq_lens[sp.r], begin = p.first_key(end - 1);
      const auto [lo, hi] = split_keys(begin, end, splits, split);
      load_queries(p, query, sp, sc);
      attend_decode<T>(p, cache, sp, lo, hi, sc, State(&states[task * size], p.group));
      if (splits == 1 || done[item].fetch_add(1, std::memory_order_acq_rel) == splits - 1)
        finish(p, &states[item * splits * size], splits, sp, out, sc.row.data());
    }
  });
}

// The extends (requests with several new tokens: prefill chunks over a cached context or not, verification spans):
// spans of up to kExtendRows / group tokens per KV head, costliest first (rows times keys seen), handed to the threads
// one at a time from a shared counter, so that the long spans at the end of a causal prompt do not all land on one
// thread. Spans still too few for the threads (a short extend over a long context: a speculative verification of
// 1 + k tokens) have their keys split as the decodes' (num_splits), the parts merged by the task that ends last.
template <typename T>
void run_extends(const Problem& p, const std::vector<int64_t>& extends, const T* query, const void* cache, T* out) {
  // Tokens per span: kExtendRows / group (each key row read by fewer spans: one 2,000-token prompt ran 25% faster
  // at 32 tokens than at 10), halved while the spans would be fewer than 4 per thread (to balance the threads), but
  // not below one vector of rows where the rows are the vector lanes (attend_tile_bf16: a span of 5 tokens x 3 query
  // heads costs what one of 1 token does; splitting its keys instead reads each key row once, not 3 times).
  const int64_t threads = at::get_num_threads(), lanes = extends_in_bf16<T>(p) ? std::max<int64_t>(1, 16 / p.group) : 1;
  int64_t tokens = std::max<int64_t>(1, kExtendRows / p.group);
  const auto count = [&](int64_t per) {
    int64_t n = 0;
    for (const int64_t r : extends) n += (p.query_len(r) + per - 1) / per * p.kv_heads;
    return n;
  };
  while (tokens > lanes && count(tokens) < 4 * threads) tokens = std::max(lanes, (tokens + 1) / 2);
  std::vector<std::pair<int64_t, Span>> spans;  // (cost, span)
  int64_t longest = 0;  // keys of the span that sees the most
  for (const int64_t r : extends) {
    const int64_t ctx = p.context_len(r);
    for (int64_t t0 = 0; t0 < p.query_len(r); t0 += tokens) {
      const int64_t t1 = std::min(p.query_len(r), t0 + tokens);
      const int64_t cost = (t1 - t0) * (ctx + t1 - p.first_key(ctx + t0));
      longest = std::max(longest, ctx + t1 - p.first_key(ctx + t0));
      for (int64_t h = 0; h < p.kv_heads; ++h) spans.push_back({cost, Span{r, h, t0, t1}});
    }
  }
  std::stable_sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  const int64_t n_spans = static_cast<int64_t>(spans.size());
  const int64_t splits = num_splits(n_spans, longest), size = State::size(p, tokens * p.group);
  std::vector<float> parts(splits > 1 ? n_spans * splits * size : 0);  // span i's split states from i * splits * size
  std::vector<std::atomic<int64_t>> done(splits > 1 ? n_spans : 0);   // value-initialised: 0
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min(threads, n_spans * splits);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch sc(p, tokens * p.group);
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < n_spans * splits;) {
      const int64_t i = task / splits, split = task % splits;
      const Span& sp = spans[i].second;
      const int64_t ctx = p.context_len(sp.r), begin = p.first_key(ctx + sp.t0), end = ctx + sp.t1;
      const auto [lo, hi] = split_keys(begin, end, splits, split);
      float* base = splits > 1 ? &parts[i * splits * size] : sc.state.data();
      float* state = base + split * State::size(p, sp.rows(p));  // finish() steps through the parts by this size
      if (!extends_in_bf16<T>(p)) load_queries(p, query, sp, sc);
      attend_extend<T>(p, query, cache, sp, lo, hi, sc, State(state, sp.rows(p)));
      if (splits == 1 || done[i].fetch_add(1, std::memory_order_acq_rel) == splits - 1)
        finish(p, base, splits, sp, out, sc.row.data());
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                           const std::optional<at::Tensor>& kv_scales, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                           int64_t sliding_window, double logits_soft_cap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && block_table.device().is_cpu() &&
                  seq_lens.device().is_cpu() && query_start_loc.device().is_cpu(),
              "paged_attention runs on the CPU: every tensor must be a CPU tensor");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_dim], last dim contiguous");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16 ||
                  query.scalar_type() == at::kHalf, "query must be float32, bfloat16 or float16");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, blocks, block_size, kv_heads, head_dim]");
  Problem p;
  const at::ScalarType stored = kv_cache.scalar_type();
  if (stored == query.scalar_type()) {
    TORCH_CHECK(!kv_scales.has_value(), "kv_scales are only for an int8 or fp8 kv_cache");
  } else {
    TORCH_CHECK(stored == at::kChar || stored == at::kFloat8_e4m3fn || stored == at::kFloat8_e5m2,
                "kv_cache must have the query's dtype, or be int8 or fp8 with kv_scales");
    TORCH_CHECK(kv_scales.has_value() && kv_scales->scalar_type() == at::kFloat && kv_scales->is_contiguous() &&
                    kv_scales->sizes().equals(kv_cache.sizes().slice(0, 4)),
                "an int8 or fp8 kv_cache needs contiguous float32 kv_scales [2, blocks, block_size, kv_heads]");
    p.storage = stored == at::kChar ? Storage::int8 : stored == at::kFloat8_e4m3fn ? Storage::e4m3 : Storage::e5m2;
    p.kv_scales = kv_scales->data_ptr<float>();
    p.scale_values = kv_scales->stride(0);
  }
  for (const at::Tensor* t : {&block_table, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "block_table, seq_lens and query_start_loc must be contiguous int32");
  TORCH_CHECK(block_table.dim() == 2 && seq_lens.dim() == 1 && query_start_loc.dim() == 1 &&
                  block_table.size(0) == seq_lens.size(0) && query_start_loc.size(0) == seq_lens.size(0) + 1,
              "need block_table [reqs, max_blocks], seq_lens [reqs] and query_start_loc [reqs + 1]");
  p.reqs = seq_lens.size(0);
  p.heads = query.size(1);
  p.dim = query.size(2);
  p.kv_heads = kv_cache.size(3);
  p.block_size = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(4) == p.dim && p.kv_heads > 0 && p.heads % p.kv_heads == 0,
              "kv_cache head_dim must equal the query's and num_heads be a multiple of num_kv_heads");
  p.group = p.heads / p.kv_heads;
  p.table_stride = block_table.size(1);
  p.values = kv_cache.stride(0);
  p.q_stride0 = query.stride(0);
  p.q_stride1 = query.stride(1);
  p.block_table = block_table.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.q_start = query_start_loc.data_ptr<int32_t>();
  p.scale = static_cast<float>(scale);
  p.window = sliding_window;
  TORCH_CHECK(logits_soft_cap >= 0, "logits_soft_cap must be positive, or 0 for none");
  p.soft_cap = static_cast<float>(logits_soft_cap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == p.heads && sinks->device().is_cpu(),
                "sinks must be a contiguous float32 CPU tensor [num_heads]");
    p.sinks = sinks->data_ptr<float>();
  }
  TORCH_CHECK(p.q_start[0] == 0 && p.q_start[p.reqs] == query.size(0),
              "query_start_loc must run from 0 to the number of query tokens");
  std::vector<int64_t> decodes, extends;
  for (int64_t r = 0; r < p.reqs; ++r) {
    TORCH_CHECK(p.query_len(r) >= 0 && p.query_len(r) <= p.seq_lens[r] &&
                    p.seq_lens[r] <= p.table_stride * p.block_size,
                "need 0 <= query_len <= seq_len <= max_blocks * block_size for every request");
    for (int64_t b = 0; b * p.block_size < p.seq_lens[r]; ++b)
      TORCH_CHECK(p.block_table[r * p.table_stride + b] >= 0 && p.block_table[r * p.table_stride + b] < kv_cache.size(1),
                  "block ids must be in [0, cache blocks)");
    if (p.query_len(r) == 1) decodes.push_back(r);
    if (p.query_len(r) > 1) extends.push_back(r);
  }
  at::Tensor out = at::empty({query.size(0), p.heads, p.dim}, query.options());
  auto go = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* q = query.data_ptr<T>();
    if (!decodes.empty()) run_decodes<T>(p, decodes, q, kv_cache.data_ptr(), out.data_ptr<T>());
    if (!extends.empty()) run_extends<T>(p, extends, q, kv_cache.data_ptr(), out.data_ptr<T>());
  };
  if (query.scalar_type() == at::kFloat)
    go(static_cast<float*>(nullptr));
  else if (query.scalar_type() == at::kBFloat16)
    go(static_cast<c10::BFloat16*>(nullptr));
  else
    go(static_cast<c10::Half*>(nullptr));
  return out;
}

}  // namespace

KILAT_LIBRARY(kilat_cpu_attn, m) {
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor? kv_scales, Tensor block_table, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int sliding_window, float logits_soft_cap=0., Tensor? sinks=None) -> Tensor",
        paged_attention);
}
