"""O3's 16-bit linears on x86 CPUs without a fast bfloat16 GEMM
(`csrc/bf16_linear_cpu.cpp`).

There (no AVX-512, so no oneDNN bfloat16 matmul) vLLM's CPU linears run
torch's bfloat16 matmul, a plain loop: the kernel reads the weight at about
the memory's speed at one row (1.3-1.9x vLLM's linear on the 1b preset's
shapes) and runs 2-7x faster from two rows on (docs/bench_bf16_linear.md).
Everywhere else, and with `VLLM_O3_CPU_BF16_LINEAR=0`, vLLM's own GEMM stays.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn
from vllm.logger import init_logger

from vllm_o3.kernels import cpu_kernels

logger = init_logger(__name__)

OPT_OUT = "VLLM_O3_CPU_BF16_LINEAR"


def pays() -> bool:
    """Whether vLLM's CPU GEMM for bfloat16 is torch's plain loop here (not
    oneDNN's, nor zentorch's on vLLM's Zen platform)."""
    from vllm.platforms import current_platform

    return not (
        cpu_kernels.has_fast_gemm(torch.bfloat16) or current_platform.is_zen_cpu()
    )


@functools.cache
def unavailable_reason() -> str | None:
    """None when `torch.ops.o3_cpu.bf16_linear` runs here, else why not."""
    reason = cpu_kernels.unavailable_reason()
    if reason is None:
        # What torch.compile traces: the operation stays opaque in the graph.
        torch.library.register_fake("o3_cpu::bf16_linear")(
            lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0])
        )
    return reason


def use_for_linears(model: nn.Module) -> int:
    """Gives every bfloat16 linear of `model` that runs vLLM's CPU GEMM
    (`cpu_linear`, set as weights are processed) O3's kernel where that GEMM
    is torch's loop; returns how many took it."""
    linears = [
        module
        for module in model.modules()
        if hasattr(module, "cpu_linear")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dtype == torch.bfloat16
        and module.weight.dim() == 2
    ]
    if not linears or not pays():
        return 0
    if os.environ.get(OPT_OUT, "1") == "0":
        logger.info_once("%s=0: O3's bfloat16 linears run torch's matmul", OPT_OUT)
        return 0
    reason = unavailable_reason()
    if reason is not None:
        logger.warning_once(
            "O3's bfloat16 linears run torch's bfloat16 matmul, a plain loop "
            "on this CPU and several times slower than O3's kernel "
            "(docs/bench_bf16_linear.md), which does not run here: %s",
            reason,
        )
        return 0
    for module in linears:
        # F.linear's contract, called without a Python frame of ours.
        module.cpu_linear = torch.ops.o3_cpu.bf16_linear.default
    return len(linears)
