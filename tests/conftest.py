"""Fixtures shared by the test modules: created checkpoints, engine settings."""

from __future__ import annotations

import os

import pytest

# vLLM on CPU reserves `gpu_memory_utilization` (0.92) of RAM for the KV cache
# by default, which CI machines cannot spare; 1 GiB holds every test's cache.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# A server or engine process that dies of a signal (a segfault in a worker)
# prints every thread's Python stack into its log.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# `LLM.apply_model` ships test functions to the worker with cloudpickle.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# Without a GPU, Triton kernels run in Triton's interpreter; this must be set
# before any kernel module is imported.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_generate_tests(metafunc):
    # Tests that take `isa` run once per ISA our C++ kernels run on here
    # (none where they do not run: skipped).
    if "isa" in metafunc.fixturenames:
        from vllm_o3.kernels import cpu_kernels

        metafunc.parametrize("isa", cpu_kernels.isas(), indirect=True)


@pytest.fixture
def isa(request) -> str:
    """Each ISA the kernels run on here: the best one, and those a CPU
    without it would run (AVX2 on an AVX512-BF16 CPU)."""
    from vllm_o3.kernels import cpu_kernels

    with cpu_kernels.using_isa(request.param):
        yield request.param


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A created `tiny` O3 checkpoint (tied head, no attention gate)."""
    from vllm_o3.tools.create import create_checkpoint

    return create_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def gated_checkpoint(tmp_path_factory):
    """A created `tiny` O3 checkpoint with the per-head attention output gate."""
    from vllm_o3.tools.create import create_checkpoint

    return create_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny-gated",
        "tiny",
        seed=1,
        attn_output_gate=True,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory):
    """A created `small` O3 checkpoint: slow enough on a CPU that a long
    request holds its slot for many seconds."""
    from vllm_o3.tools.create import create_checkpoint

    return create_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", "small", seed=2)
