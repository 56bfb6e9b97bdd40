"""What the plugin does in every vLLM process it is loaded into."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_o3.plugin import KEEP_SCHED_YIELD

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


POLLING = """
import vllm_o3.plugin
vllm_o3.plugin.register()
from vllm.distributed import utils
print(utils.USE_SCHED_YIELD)
"""


@pytest.mark.parametrize("keep", [None, "1"])
def test_vllms_queues_poll_without_sched_yield_on_cpu_unless_kept(keep):
    # sched_yield spinners starved the API server (tests/test_faults.py).
    from vllm.platforms import current_platform

    expected = str(keep == "1" or not current_platform.is_cpu())
    env = {k: v for k, v in os.environ.items() if k != KEEP_SCHED_YIELD}
    if keep is not None:
        env[KEEP_SCHED_YIELD] = keep
    result = subprocess.run(
        [sys.executable, "-c", POLLING],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    assert result.stdout.split()[-1] == expected, result.stdout


def test_vllms_queues_poll_through_the_switch_the_plugin_sets():
    # The plugin's setting only works while vLLM's shared-memory queues call
    # `vllm.distributed.utils.sched_yield`, which reads USE_SCHED_YIELD.
    import inspect

    from vllm.distributed import utils
    from vllm.distributed.device_communicators import shm_broadcast

    assert shm_broadcast.sched_yield is utils.sched_yield
    assert "USE_SCHED_YIELD" in inspect.getsource(utils.sched_yield)
