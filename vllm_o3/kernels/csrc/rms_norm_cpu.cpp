// RMSNorm in bfloat16 for x86 CPUs where vLLM's own C++ norm rounds toward
// zero (its AVX2 build: no AVX512-BF16), which would bias the residual
// stream at every layer; PyTorch's native norm, the alternative, is ~8
// operations costing 60-80 us a call at one row of 2048 against 4-5 here.
// Same arguments as vLLM's `_C` ops, same arithmetic as its native norm
// (the row loop: `routed_tiles.h`), results rounded to nearest even.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa_tiles.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Below this many elements a thread's share is not worth waking threads.
constexpr int64_t kMinWorkPerThread = 64 * 1024;

// x and `other` (the output, or the residual) contiguous bfloat16 of one
// shape, weight a bfloat16 vector of x's width; returns x's rows.
int64_t checked_rows(const at::Tensor& x, const at::Tensor& other, const char* other_name,
                     const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() >= 1, op,
              ": x must be a contiguous bfloat16 tensor");
  TORCH_CHECK(other.sizes() == x.sizes() && other.scalar_type() == at::kBFloat16 &&
                  other.is_contiguous(),
              op, ": ", other_name, " must be a contiguous bfloat16 tensor of x's shape");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(-1),
              op, ": weight must be a contiguous bfloat16 vector of x's width ", x.size(-1));
  return x.size(-1) ? x.numel() / x.size(-1) : 0;
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* mutable_bits(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// Each row of x (and residual, when given) through `tiles().rms_norm`.
void norm_rows(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, double eps,
               int64_t rows, int64_t n, uint16_t* residual_out, uint16_t* out) {
  const auto rms_norm_row = tiles().rms_norm;
  at::parallel_for(0, rows, std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(1, n)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> sum((n + kLanes - 1) / kLanes * kLanes);
                     for (int64_t r = begin; r < end; ++r) {
                       rms_norm_row(x + r * n, residual ? residual + r * n : nullptr, weight,
                                    static_cast<float>(eps), n, sum.data(),
                                    residual_out ? residual_out + r * n : nullptr, out + r * n);
                     }
                   });
}

// out <- rms_norm(x) * weight, as vLLM's `_C::rms_norm`.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = checked_rows(x, out, "out", weight, "rms_norm");
  norm_rows(bits(x), nullptr, bits(weight), eps, rows, x.size(-1), nullptr, mutable_bits(out));
}

// residual <- x + residual, x <- rms_norm(that sum) * weight, in place, as
// vLLM's `_C::fused_add_rms_norm`.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  const int64_t rows = checked_rows(x, residual, "residual", weight, "fused_add_rms_norm");
  norm_rows(bits(x), bits(residual), bits(weight), eps, rows, x.size(-1), mutable_bits(residual),
            mutable_bits(x));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(o3_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(fused_add_rms_norm));
}
