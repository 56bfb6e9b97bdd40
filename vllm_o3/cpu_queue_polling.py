"""How vLLM's engine and worker processes wait on each other on CPU.

They talk through shared-memory queues (`MessageQueue`) whose readers spin for
a second after every message, on the assumption that the engine has a core of
its own: vLLM's automatic CPU binding reserves one for it. On CPU that spinner
shares the machine with the model's OpenMP threads, so the plugin changes two
things, each with a switch:

- spinners call `time.sleep(0)` rather than `os.sched_yield()`, which starved
  the API server (`VLLM_O3_CPU_SCHED_YIELD=1` keeps vLLM's polling whole);
- where the model's OpenMP threads take every core (`VLLM_CPU_OMP_THREADS_BIND`
  naming all of them, or `nobind`), a busy reader blocks on the notification
  the writer already sends with every message instead of spinning: the engine
  process then stops taking a core from the model for the whole forward pass
  (`VLLM_O3_CPU_NOTIFICATION_WAIT=1`/`0` forces it on or off).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

KEEP_SCHED_YIELD = "VLLM_O3_CPU_SCHED_YIELD"
NOTIFICATION_WAIT = "VLLM_O3_CPU_NOTIFICATION_WAIT"
# Longest a busy reader blocks before it looks at the queue again, so a
# notification lost between the writer and the reader costs 1 ms, not a stall.
NOTIFICATION_POLL_MS = 1


def every_core_binding() -> str:
    """A `VLLM_CPU_OMP_THREADS_BIND` value naming every core this process may use."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))))


def omp_threads_take_every_core(
    bind: str, reserved: str | None, cpus: set[int]
) -> bool:
    """Whether the model's OpenMP threads, as `VLLM_CPU_OMP_THREADS_BIND`
    (`bind`) and `VLLM_CPU_NUM_OF_RESERVED_CPU` (`reserved`) place them, leave
    none of `cpus` to the engine process."""
    if bind == "auto":
        return reserved == "0"
    if bind == "nobind":
        return True
    from vllm.utils.cpu_resource_utils import parse_id_list

    try:
        bound = {cpu for ids in bind.split("|") for cpu in parse_id_list(ids)}
    except ValueError:  # vLLM refuses the value itself, naming it
        return False
    return cpus <= bound


def notification_wait(idle_wait: Callable) -> Callable:
    """A `SpinCondition.wait` that, while the reader is busy, blocks on the
    writer's notification for at most `NOTIFICATION_POLL_MS` instead of
    yielding once and returning; an idle reader waits as `idle_wait` does."""
    import zmq

    def wait(self, timeout_ms: int | None = None) -> None:
        if time.monotonic() > self.last_read + self.busy_loop_s:
            idle_wait(self, timeout_ms)
            return
        poll_ms = NOTIFICATION_POLL_MS
        if timeout_ms is not None:
            poll_ms = min(poll_ms, timeout_ms)
        if self.local_notify_socket in dict(self.poller.poll(timeout=poll_ms)):
            # The notify socket keeps only the latest message (zmq.CONFLATE).
            self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

    wait.vllm_wait = idle_wait
    return wait


def configure_queue_polling() -> None:
    """Apply the module's two changes in this process, on CPU only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get(KEEP_SCHED_YIELD) == "1":
        return
    from vllm.distributed import utils
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.logger import init_logger

    logger = init_logger(__name__)
    if hasattr(utils, "USE_SCHED_YIELD"):
        utils.USE_SCHED_YIELD = False
    else:
        logger.warning_once(
            "vllm.distributed.utils has no USE_SCHED_YIELD in this vLLM: its "
            "queues keep polling with sched_yield, which can starve the API "
            "server on CPU (docs/reliability.md)."
        )
    forced = os.environ.get(NOTIFICATION_WAIT)
    if forced is None:
        block = omp_threads_take_every_core(
            os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
            os.sched_getaffinity(0),
        )
    else:
        block = forced == "1"
    if block and not hasattr(SpinCondition.wait, "vllm_wait"):
        SpinCondition.wait = notification_wait(SpinCondition.wait)
        logger.info_once(
            "CPU: vLLM's queue readers block on the writer's notification "
            "instead of spinning (%s=0 spins).",
            NOTIFICATION_WAIT,
        )
