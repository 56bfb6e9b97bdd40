// SwiGLU's activation, silu(gate) * up, for the full FFN of the routed
// layers on x86 CPUs with AVX512-BF16 or AVX2 (the row loop:
// `routed_tiles.h`). vLLM runs its own (`SiluAndMul`) as a torch.compile'd
// function when called inside an opaque op such as the routed FFN: in the
// engine that cost 0.5-0.9 ms per call at one row, on a model whose whole
// decode step is 80-90 ms; here it is one pass over the rows, computed in
// float32 and rounded to bfloat16 once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa_tiles.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kChunk = 1024;  // output columns of one unit of work
// Below this many outputs a thread's share is not worth waking threads.
constexpr int64_t kMinWorkPerThread = 32 * 1024;

// x [rows, 2d] (gate | up) -> [rows, d], as vLLM's SiluAndMul.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "silu_and_mul: x must be a contiguous 2-D bfloat16 tensor");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: x's width ", x.size(1), " is odd");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto silu_and_mul_row = tiles().silu_and_mul;
  const int64_t chunks = (d + kChunk - 1) / kChunk;
  at::parallel_for(0, rows * chunks, std::max<int64_t>(1, kMinWorkPerThread / kChunk),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t unit = begin; unit < end; ++unit) {
                       const int64_t r = unit / chunks, c0 = unit % chunks * kChunk;
                       const uint16_t* row = xp + r * 2 * d;
                       silu_and_mul_row(row + c0, row + d + c0, op + r * d + c0,
                                        std::min(kChunk, d - c0));
                     }
                   });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(o3_cpu, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
}
