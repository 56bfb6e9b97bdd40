// What the other kernels of this folder need from the CPU they run on.

#include <torch/library.h>

namespace {

bool avx512_bf16_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(o3_cpu, m) {
  m.def("avx512_bf16_supported() -> bool");
  m.impl("avx512_bf16_supported", c10::DispatchKey::CatchAll,
         TORCH_FN(avx512_bf16_supported));
}
