"""The C++ CPU kernels of `csrc/` (the `torch.ops.o3_cpu` operations): built
together on first use by torch's C++ extension builder (cached under
~/.cache/torch_extensions, about 20 s once).

They run wherever this is None: an x86 CPU with AVX512-BF16 (Intel Cooper
Lake / Sapphire Rapids on, AMD Zen 4 on) or AVX2 with FMA (AMD Zen to Zen 3,
Intel Haswell on), and a C++ compiler (which vLLM's compiled mode on CPU
needs anyway). Elsewhere `unavailable_reason` says why, and each caller logs
it and runs its PyTorch path. `has_fast_gemm` says whether torch's own GEMM,
which the callers hand the rest to, is a fast one on this CPU.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import re
from collections.abc import Iterator
from pathlib import Path

import torch

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernels are built and this CPU runs them, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they are x86 code and this CPU is {platform.machine()}"
    try:
        from torch.utils.cpp_extension import load

        load(
            # One build per torch version: a build against another one's
            # headers would not load.
            name="vllm_o3_cpu_kernels_torch_" + re.sub(r"\W", "_", torch.__version__),
            sources=[str(source) for source in SOURCES],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as e:  # a missing compiler or ninja, a failed build
        return f"building {', '.join(s.name for s in SOURCES)} failed: {e}"
    if not torch.ops.o3_cpu.kernel_isa():
        return "this CPU has neither AVX512-BF16 nor AVX2 with FMA"
    return None


def isas() -> list[str]:
    """The ISAs the kernels can run on here, best first."""
    if unavailable_reason() is not None:
        return []
    if torch.ops.o3_cpu.avx512_bf16_supported():
        return ["avx512_bf16", "avx2"]
    return ["avx2"]


@contextlib.contextmanager
def using_isa(isa: str) -> Iterator[None]:
    """The kernels on `isa` (one of `isas()`) for a while: the best one is
    what runs; tests and benchmarks compare the others."""
    best = torch.ops.o3_cpu.kernel_isa()
    torch.ops.o3_cpu.use_isa(isa)
    try:
        yield
    finally:
        torch.ops.o3_cpu.use_isa(best)


@functools.cache
def has_fast_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMM for `dtype` is a fast one here, and so vLLM's
    CPU linears (oneDNN's, which needs AVX-512 on x86 for 16-bit types).
    Without it torch's 16-bit matmul is a plain loop: on an AMD Zen 3 5x
    slower than float32 (docs/bench_int4_linear.md)."""
    checks = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
    }
    return dtype not in checks or checks[dtype]()
