// One pre-norm decoder layer of the Llama family (grouped-query attention with rotary embeddings, SwiGLU MLP) for a
// step on the CPU (decodes, verification spans, prefill chunks, any mix of them), as one op. A batch-1 decode step of
// a small model is dominated by Python and dispatch between a dozen small kernels per layer (docs/benchmarks.md,
// "Fused decoder layer"); this op runs the same kernels in the same order from C++, so its results are bit for bit
// those of the Python path in kilat/model_executor/models/llama.py (LlamaDecoderLayer.forward with the cpu attention
// backend), which stays the oracle and the fallback. The kernels are the other extensions' ops, called through the
// dispatcher (the libraries are loaded first, kilat/model_executor/native.py):
//   kilat_cpu_<isa>::rms_norm / add_rms_norm / rotary / silu_and_mul (cpu_layers.cpp), kilat_quant_<isa>::gemm
//   (quant_gemm.cpp), kilat_cpu_attn_<isa>::paged_attention (cpu_attention.cpp), all of the same ISA level (<isa>,
//   kilat_library.h); only the KV write (a row copy per token) is done here.
//
// Op (namespace kilat_cpu_decoder_<isa>):
//   decoder_layer(x [T, hidden], residual [T, hidden]?, norms, eps, weights, quant, biases, cos [T, 1, hd],
//                 sin [T, 1, hd], kv_cache [2, blocks, block_size, kvh, hd], slot_mapping int64 [T],
//                 block_table int32 [R, nb], seq_lens int32 [R], query_start_loc int32 [R + 1], num_heads, scale,
//                 sliding_window)
//     -> (mlp output [T, hidden], residual [T, hidden])
//   norms: [input_layernorm, post_attention_layernorm] weights, then [q_norm, k_norm] for per-head q/k RMSNorm;
//   weights: (qweight, scales) of qkv_proj, o_proj, gate_up_proj, down_proj in that order (the packed layout of
//   kilat/model_executor/layers/quantization/kernels.py); quant: (bits, group_size, N, K) of each, same order;
//   biases: one optional bias per projection. Without `residual` (the first layer) the residual is x itself.
//   The T tokens are those of R requests, request r's at query_start_loc[r] .. query_start_loc[r + 1] - 1, the last
//   positions of its seq_lens[r] (paged_attention's convention); token t's key and value go to slot slot_mapping[t]
//   (block * block_size + offset) before the step's tokens attend their contexts.
//   ready() -> whether the kernels it calls are registered with the signatures it uses.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kilat_library.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The called ops' C++ signatures (their schemas are in the files named above).
using RmsNorm = Tensor(const Tensor&, const Tensor&, double);
using AddRmsNorm = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double);
using Rotary = Tensor(const Tensor&, const Tensor&, const Tensor&);
using SiluAndMul = Tensor(const Tensor&);
using Gemm = Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t, int64_t, const OptTensor&);
using PagedAttention = Tensor(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                              const Tensor&, double, int64_t, double, const OptTensor&);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = op<RmsNorm>(KILAT_OP_NAME(kilat_cpu, rms_norm));
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm = op<AddRmsNorm>(KILAT_OP_NAME(kilat_cpu, add_rms_norm));
  c10::TypedOperatorHandle<Rotary> rotary = op<Rotary>(KILAT_OP_NAME(kilat_cpu, rotary));
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul = op<SiluAndMul>(KILAT_OP_NAME(kilat_cpu, silu_and_mul));
  c10::TypedOperatorHandle<Gemm> gemm = op<Gemm>(KILAT_OP_NAME(kilat_quant, gemm));
  c10::TypedOperatorHandle<PagedAttention> paged_attention =
      op<PagedAttention>(KILAT_OP_NAME(kilat_cpu_attn, paged_attention));
};

const Ops& ops() {
  static const Ops handles;  // looked up once, on the first call (the kernels' libraries are loaded by then)
  return handles;
}

// y = x @ W.T + b of projection i (0 qkv, 1 o, 2 gate_up, 3 down).
Tensor project(const Tensor& x, int i, at::TensorList weights, at::IntArrayRef quant,
               const c10::List<OptTensor>& biases) {
  const int64_t* q = &quant[4 * i];
  return ops().gemm.call(x, weights[2 * i], weights[2 * i + 1], q[0], q[1], q[2], q[3], biases.get(i));
}

// kv_cache[0 / 1] at slot slot_mapping[t] = key / value row t ([T, kvh, hd] views with a contiguous last dim); every
// slot is checked before the first write.
void write_kv(const Tensor& key, const Tensor& value, const Tensor& kv_cache, const Tensor& slot_mapping) {
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value rows must be contiguous");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2), row = heads * dim;
  const int64_t item = kv_cache.element_size();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot_mapping must be in [0, blocks * block_size)");
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const int64_t plane = kv_cache.stride(0) * item;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int which = 0; which < 2; ++which) {
      const Tensor& src = which == 0 ? key : value;
      char* dst = base + which * plane + slot[t] * row * item;
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(dst + h * dim * item,
                    static_cast<const char*>(src.data_ptr()) + (t * src.stride(0) + h * src.stride(1)) * item,
                    dim * item);
    }
  }
}

std::tuple<Tensor, Tensor> decoder_layer(const Tensor& x, const OptTensor& residual_in, at::TensorList norms,
                                         double eps, at::TensorList weights, at::IntArrayRef quant,
                                         const c10::List<OptTensor>& biases, const Tensor& cos, const Tensor& sin,
                                         const Tensor& kv_cache, const Tensor& slot_mapping, const Tensor& block_table,
                                         const Tensor& seq_lens, const Tensor& query_start_loc, int64_t num_heads,
                                         double scale, int64_t sliding_window) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x must be a CPU tensor [T, hidden]");
  for (const Tensor* t : {&cos, &sin, &kv_cache, &slot_mapping, &block_table, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->device().is_cpu(), "decoder_layer runs on the CPU: every tensor must be a CPU tensor");
  TORCH_CHECK(norms.size() == 2 || norms.size() == 4, "norms must hold 2 weights, or 4 with q/k norms");
  TORCH_CHECK(weights.size() == 8 && quant.size() == 16 && biases.size() == 4,
              "weights, quant and biases must describe the 4 projections (qkv, o, gate_up, down)");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == x.scalar_type(),
              "kv_cache must be contiguous [2, blocks, block_size, kv_heads, head_dim] of x's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == x.size(0),
              "slot_mapping must be contiguous int64 [T]");
  const int64_t tokens = x.size(0), kv_heads = kv_cache.size(3), dim = kv_cache.size(4);
  const int64_t q_size = num_heads * dim, kv_size = kv_heads * dim;
  TORCH_CHECK(quant[2] == q_size + 2 * kv_size, "qkv_proj must have num_heads * head_dim + 2 * kv size outputs");

  Tensor h, residual;
  if (residual_in.has_value()) {
    std::tie(h, residual) = ops().add_rms_norm.call(x, *residual_in, norms[0], eps);
  } else {
    h = ops().rms_norm.call(x, norms[0], eps);
    residual = x;
  }
  const Tensor qkv = project(h, 0, weights, quant, biases);  // [T, q + 2 kv]
  Tensor q, k;
  if (norms.size() == 4) {
    q = ops().rotary.call(ops().rms_norm.call(qkv.narrow(1, 0, q_size).view({tokens, num_heads, dim}), norms[2], eps),
                          cos, sin);
    k = ops().rotary.call(
        ops().rms_norm.call(qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, dim}), norms[3], eps), cos, sin);
  } else {
    const Tensor qk = ops().rotary.call(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + kv_heads, dim}),
                                        cos, sin);
    q = qk.narrow(1, 0, num_heads);
    k = qk.narrow(1, num_heads, kv_heads);
  }
  const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, dim});
  write_kv(k, v, kv_cache, slot_mapping);
  const Tensor attn = ops().paged_attention.call(q, kv_cache, std::nullopt, block_table, seq_lens, query_start_loc,
                                                        scale, sliding_window, 0.0, std::nullopt);
  const Tensor o = project(attn.view({tokens, q_size}), 1, weights, quant, biases);
  Tensor h2;
  std::tie(h2, residual) = ops().add_rms_norm.call(o, residual, norms[1], eps);
  const Tensor act = ops().silu_and_mul.call(project(h2, 2, weights, quant, biases));
  return {project(act, 3, weights, quant, biases), residual};
}

// Whether every kernel this op calls is registered with the signature it calls it with (checked once, at bind time,
// so that a mismatch means the Python path instead of a failed step).
bool ready() {
  try {
    ops();
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

}  // namespace

KILAT_LIBRARY(kilat_cpu_decoder, m) {
  m.def("ready() -> bool", ready);
  m.def("decoder_layer(Tensor x, Tensor? residual, Tensor[] norms, float eps, Tensor[] weights, int[] quant, "
        "Tensor?[] biases, Tensor cos, Tensor sin, Tensor kv_cache, Tensor slot_mapping, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, int num_heads, float scale, int sliding_window) -> (Tensor, Tensor)",
        decoder_layer);
}
