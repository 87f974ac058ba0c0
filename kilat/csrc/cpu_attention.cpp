// Paged decode attention for CPU: each decode's one query token attends its whole context, read in place from the
// paged KV cache (no gather, no mask). The torch path this replaces is _decode_attention in
// kilat/model_executor/attention/torch_ref.py, which stays the oracle and the fallback.
//
// Work item: one (decode, KV head); its g = num_heads / num_kv_heads query heads are computed together, so each key
// and value row is read (and converted to float32) once per item. Keys go in tiles of kTile with an online softmax
// (FlashAttention-2, Dao 2023): scores, softmax and the weighted V sum in float32, the output rounded once to the
// query dtype. When the items share out badly over the threads (e.g. one decode's 3 KV heads on 2 threads) and the
// context is long enough, each item's keys are split across threads (flash-decoding, see num_splits) and the partial
// results merged by their log-sum-exp. AVX-512 (or AVX2 with FMA and F16C) for the row conversions, dot products,
// exponentials and V sums where compiled in, portable loops otherwise (same arithmetic up to summation order and the
// exponential's last bit).
//
// Op (namespace kilat_cpu_attn): paged_decode(query [D, H, hd], kv_cache [2, blocks, block_size, KVH, hd],
// block_ids int64 [D * nb], seq_lens int64 [D], scale, sliding_window) -> [D, H, hd] in the query dtype.
// query may be a strided view (last dimension contiguous); kv_cache contiguous, of the query's dtype (float32,
// bfloat16 or float16); block_ids holds each decode's first nb block ids; decode d (its token at position
// p = seq_lens[d] - 1) sees keys j with p - sliding_window < j <= p (sliding_window <= 0: all j <= p).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#define KILAT_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KILAT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 16;             // keys per online-softmax step
constexpr int64_t kSplitMinChunk = 64;    // keys per split of the longest context, at least (see num_splits)

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
struct Problem {
  int64_t decodes, heads, kv_heads, group, dim, block_size, num_blocks;
  int64_t values;                // offset of the values plane in the cache (elements)
  int64_t q_stride0, q_stride1;  // query strides (elements) of dimensions 0 and 1
  const int64_t* block_ids;
  const int64_t* seq_lens;
  float scale;
  int64_t window;

  int64_t items() const { return decodes * kv_heads; }

  // Keys [begin, end) that decode d sees.
  void keys(int64_t d, int64_t& begin, int64_t& end) const {
    end = seq_lens[d];
    begin = window > 0 ? std::max<int64_t>(0, end - window) : 0;
  }

  // Offset (elements) of the key row at position pos of decode d's KV head h; its value row is `values` further.
  int64_t key_row(int64_t d, int64_t h, int64_t pos) const {
    const int64_t block = block_ids[d * num_blocks + pos / block_size];
    return ((block * block_size + pos % block_size) * kv_heads + h) * dim;
  }
};

// Softmax state of one item's `group` query heads over some keys, float32 [group * (dim + 2)]: running maxima m
// [group], sums of exponentials l [group], the unnormalised outputs acc [group, dim]. A state that saw no key has
// m = -inf, l = 0, acc = 0.
struct State {
  float* m;
  float* l;
  float* acc;
  State(float* base, const Problem& p) : m(base), l(base + p.group), acc(base + 2 * p.group) {}
  static int64_t size(const Problem& p) { return p.group * (p.dim + 2); }

  // Back to the state that saw no key.
  void reset(const Problem& p) {
    std::fill(m, m + p.group, -std::numeric_limits<float>::infinity());
    std::fill(l, l + p.group, 0.f);
    std::fill(acc, acc + p.group * p.dim, 0.f);
  }
};

// Per-thread scratch: the item's queries (float32, times scale), one tile's keys, values and scores, an output row.
struct Scratch {
  std::vector<float> q, k, v, s, row;
  explicit Scratch(const Problem& p)
      : q(p.group * p.dim), k(kTile * p.dim), v(kTile * p.dim), s(p.group * kTile), row(p.dim) {}
};

template <typename T>
void load_queries(const Problem& p, const T* query, int64_t d, int64_t h, Scratch& sc) {
  for (int64_t g = 0; g < p.group; ++g) {
    float* q = &sc.q[g * p.dim];
    to_float(query + d * p.q_stride0 + (h * p.group + g) * p.q_stride1, q, p.dim);
    scale(p.scale, q, p.dim);
  }
}

// Attend keys [begin, end) of decode d's KV head h into `st` (which starts empty); queries already in sc.q.
template <typename T>
void attend(const Problem& p, const T* cache, int64_t d, int64_t h, int64_t begin, int64_t end, Scratch& sc,
            State st) {
  const int64_t dim = p.dim;
  st.reset(p);
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    for (int64_t j = 0; j < n; ++j) {  // each key and value row read and converted once for the whole group
      const int64_t row = p.key_row(d, h, t0 + j);
      to_float(cache + row, &sc.k[j * dim], dim);
      to_float(cache + p.values + row, &sc.v[j * dim], dim);
    }
    for (int64_t g = 0; g < p.group; ++g) {
      float* s = sc.s.data();
      dots(&sc.q[g * dim], sc.k.data(), n, dim, s);
      float* acc = &st.acc[g * dim];
      scale(softmax_step(s, n, st.m[g], st.l[g]), acc, dim);
      weighted_sum(s, sc.v.data(), n, dim, acc);
    }
  }
}

#ifdef KILAT_AVX2
// attend() for G <= 3 query heads per KV head and head_dim a multiple of 16, without attend's float32 copies of each
// tile's K and V rows (on AVX2 CPUs those conversions and stores took about half the time): each 8 values of a key or
// value row are converted once, in a register, and used for all G heads. Scores of 4 keys x G heads in 4G independent
// FMA chains, each head's 4 sums in one hadd tree; the V sums as attend's (per lane, key by key), 16 lanes at a time.
// Not inlined: its registers then do not depend on the caller's loop (inlined in run's, it measured 1% slower).
template <typename T, int G>
__attribute__((noinline)) void attend_rows(const Problem& p, const T* cache, int64_t d, int64_t h, int64_t begin,
                                           int64_t end, Scratch& sc, State st) {
  const int64_t dim = p.dim;
  st.reset(p);
  const T* krow[kTile];
  const T* vrow[kTile];
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    for (int64_t j = 0; j < n; ++j) {
      krow[j] = cache + p.key_row(d, h, t0 + j);
      vrow[j] = krow[j] + p.values;
    }
    float* s = sc.s.data();  // [G, kTile]
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      __m256 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < 4; ++r) acc[g][r] = _mm256_setzero_ps();
      for (int64_t i = 0; i < dim; i += 8)
        for (int r = 0; r < 4; ++r) {
          const __m256 kv = load8(krow[j + r] + i);
          for (int g = 0; g < G; ++g) acc[g][r] = _mm256_fmadd_ps(_mm256_loadu_ps(&sc.q[g * dim + i]), kv, acc[g][r]);
        }
      for (int g = 0; g < G; ++g) store_sums4(acc[g], s + g * kTile + j);
    }
    for (; j < n; ++j) {
      __m256 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
      for (int64_t i = 0; i < dim; i += 8) {
        const __m256 kv = load8(krow[j] + i);
        for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(&sc.q[g * dim + i]), kv, acc[g]);
      }
      for (int g = 0; g < G; ++g) s[g * kTile + j] = hsum8(acc[g]);
    }
    for (int g = 0; g < G; ++g) scale(softmax_step(s + g * kTile, n, st.m[g], st.l[g]), &st.acc[g * dim], dim);
    for (int64_t i = 0; i < dim; i += 16) {
      __m256 a[G][2];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 2; ++c) a[g][c] = _mm256_loadu_ps(&st.acc[g * dim + i + 8 * c]);
      for (int64_t jj = 0; jj < n; ++jj) {
        const __m256 v0 = load8(vrow[jj] + i), v1 = load8(vrow[jj] + i + 8);
        for (int g = 0; g < G; ++g) {
          const __m256 pj = _mm256_set1_ps(s[g * kTile + jj]);
          a[g][0] = _mm256_fmadd_ps(pj, v0, a[g][0]);
          a[g][1] = _mm256_fmadd_ps(pj, v1, a[g][1]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 2; ++c) _mm256_storeu_ps(&st.acc[g * dim + i + 8 * c], a[g][c]);
    }
  }
}
#endif

// attend_rows where it applies (AVX2, G <= 3, head_dim a multiple of 16), else attend.
template <typename T>
void attend_item(const Problem& p, const T* cache, int64_t d, int64_t h, int64_t begin, int64_t end, Scratch& sc,
                 State st) {
#ifdef KILAT_AVX2
  if (p.dim % 16 == 0) {
    if (p.group == 1) return attend_rows<T, 1>(p, cache, d, h, begin, end, sc, st);
    if (p.group == 2) return attend_rows<T, 2>(p, cache, d, h, begin, end, sc, st);
    if (p.group == 3) return attend_rows<T, 3>(p, cache, d, h, begin, end, sc, st);
  }
#endif
  attend(p, cache, d, h, begin, end, sc, st);
}

// Output rows of item (d, h) from its `n_parts` states (consecutive, from `parts`), merged by log-sum-exp:
// sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M) with M = max_s m_s. Zeros when no state saw a key.
template <typename T>
void finish(const Problem& p, float* parts, int64_t n_parts, int64_t d, int64_t h, T* out, float* row) {
  const float none = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < p.group; ++g) {
    float big = none;
    for (int64_t s = 0; s < n_parts; ++s) big = std::max(big, State(parts + s * State::size(p), p).m[g]);
    std::fill(row, row + p.dim, 0.f);
    if (big != none) {
      float total = 0.f;
      for (int64_t s = 0; s < n_parts; ++s) {
        const State st(parts + s * State::size(p), p);
        const float w = std::exp(st.m[g] - big);
        total += st.l[g] * w;
        axpy(w, &st.acc[g * p.dim], row, p.dim);
      }
      scale(1.f / total, row, p.dim);
    }
    T* o = out + (d * p.heads + h * p.group + g) * p.dim;
    for (int64_t i = 0; i < p.dim; ++i) o[i] = static_cast<T>(row[i]);
  }
}

// Splits per item. Tasks go to threads in contiguous runs of ceil(tasks / threads), so unsplit items take
// ceil(items / threads) item-times: 3 items on 2 threads take 2, one thread idle half of it. Splitting each item's keys
// in s parts takes ceil(items * s / threads) / s (1.5 for 3 items in halves). Take the smallest s <= threads that
// minimises it, with parts of the longest context at least kSplitMinChunk keys, and only when it saves more than 1/20:
// splitting costs about that much (partial tiles, merges; and a thread left alone runs faster than two together). On
// 2 threads, 15 and 21 items in halves gain 1/16 and 1/22 in theory, measured about 2% and -1%; 3 items, 1/4 and 15%.
int64_t num_splits(const Problem& p) {
  const int64_t threads = at::get_num_threads(), items = p.items();
  int64_t longest = 0;
  for (int64_t d = 0; d < p.decodes; ++d) {
    int64_t begin, end;
    p.keys(d, begin, end);
    longest = std::max(longest, end - begin);
  }
  const auto units = [&](int64_t s) { return (items * s + threads - 1) / threads; };  // wall time, in 1/s items
  int64_t best = 1;
  for (int64_t s = 2; s <= std::min(threads, longest / kSplitMinChunk); ++s)
    if (units(s) * best < units(best) * s) best = s;
  return 20 * units(best) < 19 * units(1) * best ? best : 1;
}

// The tasks (item, split) in one parallel region; an item's output is written by the task that finishes its last
// split (a counter per item; acq_rel so that task sees the other splits' states), not in a second region.
template <typename T>
void run(const Problem& p, const T* query, const T* cache, T* out) {
  const int64_t splits = num_splits(p);
  std::vector<float> states(p.items() * splits * State::size(p));
  std::vector<std::atomic<int64_t>> done(splits > 1 ? p.items() : 0);  // value-initialised: 0
  auto part = [&](int64_t task) { return &states[task * State::size(p)]; };
  at::parallel_for(0, p.items() * splits, 1, [&](int64_t first, int64_t last) {
    Scratch sc(p);
    for (int64_t task = first; task < last; ++task) {
      const int64_t item = task / splits, split = task % splits;
      const int64_t d = item / p.kv_heads, h = item % p.kv_heads;
      int64_t begin, end;
      p.keys(d, begin, end);
      const int64_t chunk = (end - begin + splits - 1) / splits;
      const int64_t lo = std::min(end, begin + split * chunk), hi = std::min(end, lo + chunk);
      load_queries(p, query, d, h, sc);
      attend_item(p, cache, d, h, lo, hi, sc, State(part(task), p));
      if (splits == 1 || done[item].fetch_add(1, std::memory_order_acq_rel) == splits - 1)
        finish(p, part(item * splits), splits, d, h, out, sc.row.data());
    }
  });
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_ids,
                        const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && block_ids.device().is_cpu() &&
                  seq_lens.device().is_cpu(), "paged_decode runs on the CPU: every tensor must be a CPU tensor");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [decodes, heads, head_dim], last dim contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "kv_cache must have the query's dtype");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16 ||
                  query.scalar_type() == at::kHalf, "query must be float32, bfloat16 or float16");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong && block_ids.dim() == 1 &&
                  seq_lens.dim() == 1 && block_ids.is_contiguous() && seq_lens.is_contiguous(),
              "block_ids and seq_lens must be contiguous 1-D int64");
  Problem p;
  p.decodes = query.size(0);
  p.heads = query.size(1);
  p.dim = query.size(2);
  p.kv_heads = kv_cache.size(3);
  p.block_size = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(4) == p.dim && p.kv_heads > 0 && p.heads % p.kv_heads == 0,
              "kv_cache head_dim must equal the query's and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(seq_lens.size(0) == p.decodes, "seq_lens must hold one length per decode");
  p.group = p.heads / p.kv_heads;
  p.num_blocks = p.decodes ? block_ids.size(0) / p.decodes : 0;
  TORCH_CHECK(block_ids.size(0) == p.decodes * p.num_blocks, "block_ids must hold num_blocks ids per decode");
  p.values = kv_cache.stride(0);
  p.q_stride0 = query.stride(0);
  p.q_stride1 = query.stride(1);
  p.block_ids = block_ids.data_ptr<int64_t>();
  p.seq_lens = seq_lens.data_ptr<int64_t>();
  p.scale = static_cast<float>(scale);
  p.window = sliding_window;
  for (int64_t d = 0; d < p.decodes; ++d)
    TORCH_CHECK(p.seq_lens[d] >= 0 && p.seq_lens[d] <= p.num_blocks * p.block_size,
                "seq_lens must be in [0, num_blocks * block_size]");
  for (int64_t i = 0; i < block_ids.size(0); ++i)
    TORCH_CHECK(p.block_ids[i] >= 0 && p.block_ids[i] < kv_cache.size(1), "block_ids must be in [0, cache blocks)");
  at::Tensor out = at::empty({p.decodes, p.heads, p.dim}, query.options());
  if (p.decodes == 0) return out;
  auto go = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    run<T>(p, query.data_ptr<T>(), kv_cache.data_ptr<T>(), out.data_ptr<T>());
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

TORCH_LIBRARY(kilat_cpu_attn, m) {
  m.def("paged_decode(Tensor query, Tensor kv_cache, Tensor block_ids, Tensor seq_lens, float scale, "
        "int sliding_window) -> Tensor", paged_decode);
}
