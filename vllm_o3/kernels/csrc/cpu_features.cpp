// What the other kernels of this folder need from the CPU they run on, and
// which ISA they run on (`isa.h`).

#include <torch/library.h>

#include <atomic>
#include <string>

#include "isa.h"

namespace o3_cpu {
namespace {

bool avx512_bf16_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
}

bool avx2_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool supported(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return avx512_bf16_supported();
    case Isa::kAvx2: return avx2_supported();
    default: return true;
  }
}

std::atomic<Isa>& chosen_isa() {
  static std::atomic<Isa> isa{avx512_bf16_supported() ? Isa::kAvx512Bf16
                              : avx2_supported()      ? Isa::kAvx2
                                                      : Isa::kNone};
  return isa;
}

constexpr const char* kNames[] = {"", "avx2", "avx512_bf16"};  // by Isa

// "avx512_bf16", "avx2", or "" where the CPU has neither.
std::string kernel_isa() { return kNames[static_cast<int>(active_isa())]; }

// Runs the kernels on another ISA this CPU has (tests compare them).
void use_isa(const std::string& name) {
  for (const Isa isa : {Isa::kAvx2, Isa::kAvx512Bf16}) {
    if (name == kNames[static_cast<int>(isa)]) {
      TORCH_CHECK(supported(isa), "use_isa: this CPU has no ", name);
      chosen_isa() = isa;
      return;
    }
  }
  TORCH_CHECK(false, "use_isa: unknown ISA '", name, "' (avx2, avx512_bf16)");
}

}  // namespace

Isa active_isa() { return chosen_isa().load(std::memory_order_relaxed); }

}  // namespace o3_cpu

TORCH_LIBRARY_FRAGMENT(o3_cpu, m) {
  m.def("avx512_bf16_supported() -> bool");
  m.impl("avx512_bf16_supported", c10::DispatchKey::CatchAll,
         TORCH_FN(o3_cpu::avx512_bf16_supported));
  m.def("kernel_isa() -> str");
  m.impl("kernel_isa", c10::DispatchKey::CatchAll, TORCH_FN(o3_cpu::kernel_isa));
  m.def("use_isa(str name) -> ()");
  m.impl("use_isa", c10::DispatchKey::CatchAll, TORCH_FN(o3_cpu::use_isa));
}
