"""The C++ CPU kernels of `csrc/` (the `torch.ops.o3_cpu` operations): built
together on first use by torch's C++ extension builder (cached under
~/.cache/torch_extensions, about 20 s once).

They run wherever this is None: an x86 CPU with AVX512-BF16 (Intel Cooper
Lake / Sapphire Rapids on, AMD Zen 4 on) and a C++ compiler (which vLLM's
compiled mode on CPU needs anyway). Elsewhere `unavailable_reason` says why,
and each caller logs it and runs its PyTorch path.
"""

from __future__ import annotations

import functools
import platform
import re
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
    if not torch.ops.o3_cpu.avx512_bf16_supported():
        return "this CPU has no AVX512-BF16"
    return None
