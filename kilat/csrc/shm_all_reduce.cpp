// Sum all-reduce of tensor-parallel ranks on one host through a shared buffer (kilat/distributed/shm_all_reduce.py
// maps the buffer and holds the sequence number; this op is one call's whole work, so a decode step's small
// reduces cost microseconds instead of the dozens a chain of torch ops costs in Python).
//
// Op (namespace kilat_shm_<isa>):
//   all_reduce(x, slots, flags, rank, seq) -> (): x float32/bfloat16/float16, contiguous, on the CPU, numel n;
//     slots float32 [2, world, max_elems] and flags int64 [2, world], both in memory every rank maps; seq > 0 the
//     call's sequence number (the same on every rank, one more than the last call's). With b = seq & 1: copy x
//     (as float32) into slots[b][rank][:n]; store seq into flags[b][rank] (release); wait until every
//     flags[b][r] >= seq (acquire loads; spin with a pause, then yield the core after 4096 checks); then
//     x = sum over r = 0 .. world-1, in that order, of slots[b][r][:n] (float32, rounded once to x's dtype), so
//     every rank gets the same bits. Buffer b is written again only at seq + 2, after every rank has published
//     seq + 1, that is after every rank has read buffer b.
// Raises (TORCH_CHECK): x not contiguous or on another device, n > max_elems, slots/flags of the wrong dtype or
// shape, rank out of range, seq < 1.

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "kilat_library.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <sched.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KILAT_PAUSE() _mm_pause()
#else
#define KILAT_PAUSE() ((void)0)
#endif

namespace {

void all_reduce(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& flags, int64_t rank, int64_t seq) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "all_reduce: x must be a contiguous CPU tensor");
  TORCH_CHECK(slots.scalar_type() == at::kFloat && slots.dim() == 3 && slots.size(0) == 2 && slots.is_contiguous(),
              "all_reduce: slots must be contiguous float32 [2, world, max_elems]");
  const int64_t world = slots.size(1), max_elems = slots.size(2), n = x.numel();
  TORCH_CHECK(flags.scalar_type() == at::kLong && flags.numel() == 2 * world && flags.is_contiguous(),
              "all_reduce: flags must be contiguous int64 [2, world]");
  TORCH_CHECK(rank >= 0 && rank < world, "all_reduce: rank ", rank, " not in [0, ", world, ")");
  TORCH_CHECK(n <= max_elems, "all_reduce: ", n, " elements, more than the buffer's ", max_elems);
  TORCH_CHECK(seq >= 1, "all_reduce: seq must be >= 1, got ", seq);
  const int64_t b = seq & 1;
  float* base = slots.data_ptr<float>() + b * world * max_elems;
  int64_t* flag = flags.data_ptr<int64_t>() + b * world;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "shm_all_reduce", [&] {
    scalar_t* data = x.data_ptr<scalar_t>();
    float* mine = base + rank * max_elems;
    for (int64_t i = 0; i < n; ++i) mine[i] = static_cast<float>(data[i]);
    __atomic_store_n(flag + rank, seq, __ATOMIC_RELEASE);
    for (int64_t r = 0; r < world; ++r) {
      for (int64_t checks = 0; __atomic_load_n(flag + r, __ATOMIC_ACQUIRE) < seq; ++checks) {
        if (checks < 4096) {
          KILAT_PAUSE();
        } else {
          sched_yield();
        }
      }
    }
    // rank by rank over contiguous runs (vectorizable), the same order of additions on every rank
    constexpr int64_t kChunk = 1024;
    float acc[kChunk];
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t len = std::min(kChunk, n - start);
      const float* first = base + start;
      for (int64_t i = 0; i < len; ++i) acc[i] = first[i];
      for (int64_t r = 1; r < world; ++r) {
        const float* other = base + r * max_elems + start;
        for (int64_t i = 0; i < len; ++i) acc[i] += other[i];
      }
      for (int64_t i = 0; i < len; ++i) data[start + i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

}  // namespace

KILAT_LIBRARY(kilat_shm, m) {
  m.def("all_reduce(Tensor(a!) x, Tensor slots, Tensor flags, int rank, int seq) -> ()", all_reduce);
}
