"""Shared pieces of the benchmarks: timing, the machine, writing results."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from vllm_o3.tools.server import free_port

DOCS = Path(__file__).resolve().parent.parent / "docs"


def median_time(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 3,
    before: Callable[[], object] | None = None,
) -> float:
    """Median wall time of `fn()` in seconds over `repeats` calls; `before`,
    if given, runs untimed before each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_times(
    fns: Sequence[Callable[[], object]],
    repeats: int,
    warmup: int = 2,
    before: Callable[[], object] | None = None,
) -> list[list[float]]:
    """Per function, its wall times in seconds over `repeats` rounds, each
    round calling every function once (`before`, if given, untimed before
    each call), round r starting from function r and going round. On a
    machine whose speed drifts from minute to minute, the ratios of one
    round's times cancel the drift (`median_ratio`); medians of separate runs
    do not. The rotation shares out what a fixed order gives a function (in
    an A/B run with a fixed order, kernels the same in both builds mostly
    read 1.03-1.07x faster in the build called after the other)."""
    times: list[list[float]] = [[] for _ in fns]
    for round_index in range(warmup + repeats):
        for i in range(len(fns)):
            index = (round_index + i) % len(fns)
            if before is not None:
                before()
            start = time.perf_counter()
            fns[index]()
            times[index].append(time.perf_counter() - start)
    return [samples[warmup:] for samples in times]


def median_ratio(a: list[float], b: list[float]) -> float:
    """Median over the rounds of a[i] / b[i]."""
    return statistics.median(p / q for p, q in zip(a, b, strict=True))


def cache_evictor() -> Callable[[], object]:
    """A function that reads twice the CPU's last-level cache of other data,
    so that the next call finds its weights in memory, as a decode step that
    streams a whole model through the caches does."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    size = 256 * 2**20  # where sysfs does not say
    with contextlib.suppress(OSError, ValueError, KeyError):
        caches = Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")
        size = max(
            int(text[:-1]) * units[text[-1]]
            for text in (path.read_text().strip() for path in caches)
        )
    return torch.ones(2 * size // 8, dtype=torch.int64).sum


def machine() -> str:
    """One line naming the machine the numbers came from."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    threads = torch.get_num_threads()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} cores ({threads} torch threads), {gpu}; "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def command_line() -> str:
    """How to rerun this benchmark, from the repository root."""
    script = Path(sys.argv[0])
    if script.parent.name == "benchmarks":
        return " ".join(["python -m", f"benchmarks.{script.stem}", *sys.argv[1:]])
    return " ".join(["python", *sys.argv])


def git_revision() -> str:
    """HEAD, with `+changes` when the working tree differs from it."""
    with contextlib.suppress(Exception):

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], capture_output=True, text=True, check=True
            ).stdout.strip()

        return git("rev-parse", "--short", "HEAD") + (
            "+changes" if git("status", "--porcelain") else ""
        )
    return "unknown"


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of `values`; None when there are none."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def weight_bytes(model) -> int:
    """Bytes of the loaded model's weights: parameters and buffers, plus the
    16-bit linear weights that vLLM's CPU backend moved into oneDNN (their
    parameter left empty), at their 16-bit size. Runs in vLLM's worker
    through `LLM.apply_model`, which fails on functions of `__main__`: so it
    lives here, importable."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            hasattr(module, "cpu_linear")
            and isinstance(weight, torch.Tensor)
            and weight.numel() == 0
        ):
            inputs = getattr(module, "input_size_per_partition", module.input_size)
            outputs = getattr(module, "output_size_per_partition", module.output_size)
            total += inputs * outputs * weight.element_size()
    return total


def vllm_linear(weight: torch.Tensor) -> torch.nn.Module:
    """vLLM's 16-bit linear layer holding `weight`, its weights processed as
    an engine's are (on CPU: vLLM's GEMM dispatch); inside
    `single_process_vllm`. Called as the model calls it: `layer(x)[0]`."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    out_features, in_features = weight.shape
    layer = ReplicatedLinear(in_features, out_features, bias=False, prefix="bench")
    layer.weight.data.copy_(weight)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def write_report(name: str, title: str, body: str) -> Path:
    """Write `docs/<name>.md` with the command, machine and revision on top."""
    DOCS.mkdir(exist_ok=True)
    path = DOCS / f"{name}.md"
    path.write_text(
        f"# {title}\n\n"
        f"Command: `{command_line()}`  \n"
        f"Machine: {machine()}  \n"
        f"Revision: {git_revision()}, {time.strftime('%Y-%m-%d')}\n\n{body}\n"
    )
    return path


@contextlib.contextmanager
def single_process_vllm() -> Iterator[None]:
    """vLLM's config and a one-rank process group, so its layers can be built
    and run outside an engine."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            cleanup_dist_env_and_memory()
