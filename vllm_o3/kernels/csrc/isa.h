// Which x86 ISA the CPU kernels of this folder run on: the best the CPU
// has, unless `o3_cpu::use_isa` chose another (tests compare them).
#pragma once

namespace o3_cpu {

enum class Isa { kNone, kAvx2, kAvx512Bf16 };

Isa active_isa();  // cpu_features.cpp

}  // namespace o3_cpu
