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
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.platforms import CpuArchEnum, current_platform

logger = init_logger(__name__)

# The CPU kernel steps through a row in vectors of 8 elements and refuses
# other widths.
CPU_KERNEL_WIDTH_MULTIPLE = 8
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# vLLM loads its kernels built for AVX512-BF16 where an x86 CPU has it; its
# AVX2 build rounds bfloat16 results toward zero (measured: every residual
# and output element), which would bias the residual stream at every layer.
BFLOAT16_ROUNDS_TO_NEAREST = (
    current_platform.get_cpu_architecture() != CpuArchEnum.X86
    or torch.cpu._is_avx512_bf16_supported()
)


class RMSNormWithCpuKernel(RMSNorm):
    """`RMSNorm` whose CPU forward is vLLM's C++ kernel (same name as a custom
    op, so `custom_ops` turns it on and off like vLLM's)."""

    def _cpu_kernel_refusal(self, *tensors: torch.Tensor) -> str | None:
        """Why the kernel cannot take these tensors, or None. It reads rows
        as contiguous memory: a strided view would come back as garbage."""
        x = tensors[0]
        if self.variance_size_override is not None or not self.has_weight:
            return "a variance size override or no weight"
        if x.dtype not in CPU_KERNEL_DTYPES or self.weight.dtype != x.dtype:
            return f"{x.dtype} input with a {self.weight.dtype} weight"
        if x.shape[-1] % CPU_KERNEL_WIDTH_MULTIPLE:
            return f"width {x.shape[-1]}, not a multiple of {CPU_KERNEL_WIDTH_MULTIPLE}"
        if not all(t.dtype == x.dtype and t.is_contiguous() for t in tensors):
            return "a strided or mixed-dtype input"
        if x.dtype == torch.bfloat16 and not BFLOAT16_ROUNDS_TO_NEAREST:
            return "bfloat16 on a CPU without AVX512-BF16, where it rounds toward zero"
        return None

    def _runs_kernel(self, *tensors: torch.Tensor) -> bool:
        refusal = self._cpu_kernel_refusal(*tensors)
        if refusal is not None:
            logger.warning_once(
                "O3 RMSNorm on CPU: vLLM's C++ kernel cannot take %s; the "
                "PyTorch norm runs, several times slower",
                refusal,
            )
        return refusal is None

    def forward_cpu(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            if not self._runs_kernel(x):
                return self.forward_native(x)
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.weight.data, self.variance_epsilon)
            return out
        if not self._runs_kernel(x, residual):
            return self.forward_native(x, residual)
        # In place, as vLLM's fused op: residual <- x + residual, x <- norm.
        ops.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return x, residual
