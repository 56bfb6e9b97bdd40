"""O3's RMSNorm: vLLM's, plus vLLM's own C++ CPU kernel where the custom op runs.

vLLM 0.32 routes `RMSNorm` through its IR op, whose C++ implementation is
registered for GPUs only, so on a CPU every norm runs as ~8 PyTorch
operations: ~2.0 s of an ~8.7 s eager prefill step of the 1b preset
(docs/bench_e2e_routing.md), against the `_C` kernels the CPU build ships.
Where vLLM compiles the model the custom op is off (`custom_ops: none`) and
Inductor fuses the native form as before.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.layers.layernorm import RMSNorm

# The CPU kernel steps through a row in vectors of 8 elements and refuses
# other widths.
CPU_KERNEL_WIDTH_MULTIPLE = 8
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RMSNormWithCpuKernel(RMSNorm):
    """`RMSNorm` whose CPU forward is vLLM's C++ kernel (same name as a custom
    op, so `custom_ops` turns it on and off like vLLM's)."""

    def _cpu_kernel_takes(self, *tensors: torch.Tensor) -> bool:
        # The kernel reads rows as contiguous memory: a strided view would
        # come back as garbage, so anything it cannot take runs natively.
        x = tensors[0]
        return (
            self.variance_size_override is None
            and self.has_weight
            and x.dtype in CPU_KERNEL_DTYPES
            and self.weight.dtype == x.dtype
            and x.shape[-1] % CPU_KERNEL_WIDTH_MULTIPLE == 0
            and all(t.dtype == x.dtype and t.is_contiguous() for t in tensors)
        )

    def forward_cpu(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            if not self._cpu_kernel_takes(x):
                return self.forward_native(x)
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.weight.data, self.variance_epsilon)
            return out
        if not self._cpu_kernel_takes(x, residual):
            return self.forward_native(x, residual)
        # In place, as vLLM's fused op: residual <- x + residual, x <- norm.
        ops.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return x, residual
