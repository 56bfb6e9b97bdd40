"""What the plugin does in every vLLM process it is loaded into."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.utils import (
    PROMPTS,
    check_logprobs_close,
    reference_generations,
    vllm_engine,
    vllm_generations,
)
from vllm_o3.cpu_queue_polling import (
    KEEP_SCHED_YIELD,
    NOTIFICATION_WAIT,
    every_core_binding,
    notification_wait,
    omp_threads_take_every_core,
)

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


@pytest.mark.parametrize(
    "bind, reserved, every_core",
    [
        ("auto", None, False),  # vLLM reserves a core for the engine
        ("auto", "0", True),
        ("nobind", None, True),
        ("0-1", None, True),
        ("0,1", None, True),
        ("0", None, False),
        ("0|1", None, True),  # two ranks, one core each
        ("0-3", None, True),  # more cores than this process may use
        ("zero", None, False),  # vLLM refuses it
    ],
)
def test_which_bindings_leave_the_engine_no_core(bind, reserved, every_core):
    assert omp_threads_take_every_core(bind, reserved, {0, 1}) is every_core


def reader_cpu_and_latency(wait, pause: float = 0.5) -> tuple[float, float]:
    """A vLLM queue reader (a thread) takes one message, then waits `pause`
    seconds, busy, for the next: its CPU time and how late that message
    arrived."""
    from vllm.distributed.device_communicators.shm_broadcast import (
        MessageQueue,
        SpinCondition,
    )

    writer = MessageQueue(1, 1)
    seen = {}

    def read() -> None:
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        reader.wait_until_ready()
        assert reader.dequeue() == "first"
        cpu = time.thread_time()
        seen["second"] = reader.dequeue()
        seen["arrived"] = time.perf_counter()
        seen["cpu"] = time.thread_time() - cpu

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SpinCondition, "wait", wait)
        thread = threading.Thread(target=read)
        thread.start()
        writer.wait_until_ready()
        writer.enqueue("first")
        time.sleep(pause)
        sent = time.perf_counter()
        writer.enqueue("second")
        thread.join(10)
    assert seen["second"] == "second"
    return seen["cpu"], seen["arrived"] - sent


def test_a_busy_reader_waits_for_the_notification_instead_of_spinning():
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    vllm_wait = getattr(SpinCondition.wait, "vllm_wait", SpinCondition.wait)
    spinning_cpu, _ = reader_cpu_and_latency(vllm_wait)
    cpu, latency = reader_cpu_and_latency(notification_wait(vllm_wait))
    # vLLM's reader spins through the pause (0.5 s of CPU on an idle
    # machine, 0.14 s seen on a busy one); this one sleeps through it.
    assert cpu < 0.05, cpu
    assert spinning_cpu > 3 * cpu, (spinning_cpu, cpu)
    assert latency < 0.05, latency


def uses_notification_wait(model) -> bool:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    return hasattr(SpinCondition.wait, "vllm_wait")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity")
def test_an_engine_on_every_core_waits_for_notifications_and_generates(
    tiny_checkpoint, monkeypatch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", every_core_binding())
    monkeypatch.delenv(NOTIFICATION_WAIT, raising=False)
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    with vllm_engine(tiny_checkpoint) as llm:
        assert llm.apply_model(uses_notification_wait) == [True]
        generations = vllm_generations(llm.generate(PROMPTS, greedy, use_tqdm=False))
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    expected = reference_generations(reference, tokenizer, PROMPTS, 12, 5)
    check_logprobs_close(expected, generations, "reference", "vllm")
