"""What the plugin does in every vLLM process it is loaded into."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

# Prints whether this process may use the AMX tile state, before and after the
# plugin's registration (arch_prctl ARCH_GET_XCOMP_PERM, bit XFEATURE_XTILEDATA).
CHECK = """
import ctypes
def tiles():
    bits = ctypes.c_uint64()
    assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(bits)) == 0
    return bool(bits.value & (1 << 18))
before = tiles()
import vllm_o3.plugin
vllm_o3.plugin.register()
print(before, tiles())
"""


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="the CPU has no AMX")
def test_the_plugin_gets_the_amx_tile_state_for_vllms_cpu_attention():
    # Without it, vLLM's AMX attention killed a server on its first request.
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True
    )
    assert result.stdout.split()[-2:] == ["False", "True"], result.stdout
