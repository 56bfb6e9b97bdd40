"""O3's RMSNorm: vLLM's, plus a C++ CPU kernel where the custom op runs.

vLLM 0.32 routes `RMSNorm` through its IR op, whose C++ implementation is
registered for GPUs only, so on a CPU every norm runs as ~8 PyTorch
operations: ~2.0 s of an ~8.7 s eager prefill step of the 1b preset
(docs/bench_e2e_routing.md), 60-80 us a call at one row, against the `_C`
kernels the CPU build ships. Those round bfloat16 toward zero on x86 CPUs
without AVX512-BF16; there O3's own kernel (`csrc/rms_norm_cpu.cpp`, same
arguments) takes bfloat16. Where vLLM compiles the model the custom op is
off (`custom_ops: none`) and Inductor fuses the native form as before.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.platforms import CpuArchEnum, current_platform

from vllm_o3.kernels import cpu_kernels

logger = init_logger(__name__)

# The CPU kernel steps through a row in vectors of 8 elements and refuses
# other widths.
CPU_KERNEL_WIDTH_MULTIPLE = 8
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# vLLM loads its kernels built for AVX512-BF16 where an x86 CPU has it; its
# AVX2 build rounds bfloat16 results toward zero (measured: every residual
# and output element), which would bias the residual stream at every layer:
# there O3's kernel takes bfloat16.
BFLOAT16_ROUNDS_TO_NEAREST = (
    current_platform.get_cpu_architecture() != CpuArchEnum.X86
    or torch.cpu._is_avx512_bf16_supported()
)


class RMSNormWithCpuKernel(RMSNorm):
    """`RMSNorm` whose CPU forward is a C++ kernel, vLLM's or O3's (same name
    as a custom op, so `custom_ops` turns it on and off like vLLM's)."""

    def _cpu_kernels(self, *tensors: torch.Tensor) -> tuple[Any, str | None]:
        """(kernels, None) with `rms_norm` and `fused_add_rms_norm` taking
        vLLM's `_C` arguments: vLLM's, or O3's for bfloat16 where vLLM's
        rounds toward zero; or (None, why there are none)."""
        refusal = self._cpu_kernel_refusal(*tensors)
        if refusal is not None:
            return None, refusal
        if tensors[0].dtype != torch.bfloat16 or BFLOAT16_ROUNDS_TO_NEAREST:
            return ops, None
        o3_refusal = cpu_kernels.unavailable_reason()
        if o3_refusal is not None:
            return None, (
                "bfloat16 on a CPU without AVX512-BF16, where it rounds toward "
                f"zero, and O3's does not run here ({o3_refusal})"
            )
        return torch.ops.o3_cpu, None

    def _cpu_kernel_refusal(self, *tensors: torch.Tensor) -> str | None:
        """Why the kernels cannot take these tensors, or None. They read rows
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
        return None

    def _kernels_for(self, *tensors: torch.Tensor) -> Any:
        kernels, refusal = self._cpu_kernels(*tensors)
        if kernels is None:
            logger.warning_once(
                "O3 RMSNorm on CPU: the C++ kernel cannot take %s; the "
                "PyTorch norm runs, several times slower",
                refusal,
            )
        return kernels

    def forward_cpu(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            kernels = self._kernels_for(x)
            if kernels is None:
                return self.forward_native(x)
            out = torch.empty_like(x)
            kernels.rms_norm(out, x, self.weight.data, self.variance_epsilon)
            return out
        kernels = self._kernels_for(x, residual)
        if kernels is None:
            return self.forward_native(x, residual)
        # In place, as vLLM's fused op: residual <- x + residual, x <- norm.
        kernels.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return x, residual
