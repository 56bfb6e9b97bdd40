"""keep_freed_memory: a freed large block is reused without page faults.

Each case runs in its own interpreter: malloc settings are per process.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="glibc malloc settings"
)

# Page faults while 64 MiB float32 tensors are allocated, written and freed
# six times, after two such rounds; prints keep_freed_memory()'s answer first.
PROBE = """
import resource
import torch
from vllm_o3.model.cpu_allocator import keep_freed_memory

print(keep_freed_memory() if {tune} else False)
def block() -> None:
    torch.empty(16 * 2**20).fill_(1.0)
block(), block()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    block()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""
BLOCK_PAGES = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")


def probe(tune: bool, **env: str) -> tuple[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(tune=tune)],
        env={**os.environ, "LD_PRELOAD": "", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    answer, faults = result.stdout.split()[-2:]
    return answer, int(faults)


def test_freed_block_is_reused():
    answer, faults = probe(tune=True)
    assert answer == "True"
    # Without it, glibc maps each of the six blocks afresh and every page
    # faults again; with it, at most one block's pages are new (glibc's
    # aligned allocation may need one more chunk before the freed ones
    # coalesce into a fit). Relative, so huge pages do not change the test.
    _, untuned_faults = probe(tune=False)
    assert untuned_faults >= 6 * BLOCK_PAGES // 512  # 2 MiB pages at most
    assert faults * 3 < untuned_faults


def test_opt_out_and_other_allocators_left_alone():
    assert probe(tune=True, VLLM_O3_CPU_KEEP_FREED_MEMORY="0")[0] == "False"
    # Only the name is read (the loader skips a library it cannot find).
    assert probe(tune=True, LD_PRELOAD="libtcmalloc_minimal.so.4")[0] == "False"
