"""O3's bfloat16 linear for CPUs without a fast bfloat16 GEMM
(`cpu_bf16_linear`) against the exact product (float64, rounded once), on
odd shapes on both of its paths (the tiles below 256 rows, the float32 GEMM
from it); what it refuses, by name; and a bfloat16 engine whose linears take
it on such a CPU, against the same engine on torch's linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.utils import PROMPTS, check_logprobs_close, vllm_engine, vllm_generations
from vllm_o3.kernels import cpu_bf16_linear

needs_kernel = pytest.mark.skipif(
    cpu_bf16_linear.unavailable_reason() is not None,
    reason=f"O3's CPU kernels do not run here: {cpu_bf16_linear.unavailable_reason()}",
)

SHAPES = [(1, 8), (7, 13), (24, 64), (25, 100), (300, 1030), (5, 0)]  # (N, K)
ROWS = [0, 1, 2, 3, 4, 5, 15, 16, 255, 256, 300]  # tiles up to 255, GEMM from 256


def exact_linear(x, weight, bias):
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_it_is_the_exact_product_rounded_once(n, k, rows, bias):
    torch.manual_seed(n * k + rows)
    x = torch.randn(rows, k).bfloat16()
    weight = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    got = torch.ops.o3_cpu.bf16_linear(x, weight, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 sums in another order than float64's, then one rounding: within
    # a bfloat16 step of the exact value.
    torch.testing.assert_close(
        got.double(), exact_linear(x, weight, b), rtol=2**-8, atol=1e-3
    )


@needs_kernel
def test_a_rows_output_does_not_depend_on_its_batch_below_256_rows():
    torch.manual_seed(0)
    x = torch.randn(255, 1030).bfloat16()
    weight = torch.randn(300, 1030).bfloat16()
    whole = torch.ops.o3_cpu.bf16_linear(x, weight, None)
    for rows in (slice(0, 1), slice(3, 5), slice(7, 14), slice(100, 255)):
        assert torch.equal(
            torch.ops.o3_cpu.bf16_linear(x[rows], weight, None), whole[rows]
        )


@needs_kernel
def test_it_takes_what_f_linear_takes():
    """Leading dimensions and a strided x: it is the linears' `cpu_linear`."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 80).bfloat16()[..., :64]  # not contiguous
    weight = torch.randn(40, 64).bfloat16()
    bias = torch.randn(40).bfloat16()
    got = torch.ops.o3_cpu.bf16_linear(x, weight, bias)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=2**-7, atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("shape", [(3, 24), (260, 24), (2, 5, 24)])
def test_its_registration_and_fake_agree_with_it(shape):
    x = torch.randn(shape).bfloat16()
    weight = torch.randn(20, 24).bfloat16()
    for bias in (None, torch.randn(20).bfloat16()):
        torch.library.opcheck(torch.ops.o3_cpu.bf16_linear.default, (x, weight, bias))


def bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (lambda: (torch.zeros(2, 8), bf16(4, 8), None), "x must be a bfloat16 tensor"),
        (
            lambda: (bf16(), bf16(4, 8), None),
            r"x must be a bfloat16 tensor \[\.\.\., K\]",
        ),
        (lambda: (bf16(2, 8), bf16(4, 6), None), r"contiguous bfloat16 \[N, 8\]"),
        (lambda: (bf16(2, 8), bf16(8, 4).t(), None), "weight must be a contiguous"),
        (lambda: (bf16(2, 8), bf16(4, 8), bf16(3)), r"bias must be .* \[4\]"),
    ],
)
def test_it_refuses_what_it_cannot_read_by_name(args, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.o3_cpu.bf16_linear(*args())


def test_its_switch_is_part_of_vllms_compile_cache_key(monkeypatch):
    """vLLM reuses a compiled graph whose key matches: one traced with O3's
    kernel must not serve an engine started with the kernel switched off."""
    from vllm import envs

    import vllm_o3.plugin

    vllm_o3.plugin.register()
    monkeypatch.delenv(cpu_bf16_linear.OPT_OUT, raising=False)
    default = envs.compile_factors()
    monkeypatch.setenv(cpu_bf16_linear.OPT_OUT, "0")
    assert envs.compile_factors() != default


def kernel_linears(model) -> tuple[int, int]:
    """Runs in the worker: (bfloat16 linears on O3's kernel, all bfloat16 linears)."""
    linears = [
        module.cpu_linear
        for module in model.modules()
        if hasattr(module, "cpu_linear") and module.weight.dtype == torch.bfloat16
    ]
    kernel = torch.ops.o3_cpu.bf16_linear.default
    return sum(f is kernel for f in linears), len(linears)


def bfloat16_run(checkpoint, enforce_eager: bool, o3_linear: bool, monkeypatch):
    """((linears on O3's kernel, bfloat16 linears), greedy generations) of a
    bfloat16 engine; without `o3_linear`, `VLLM_O3_CPU_BF16_LINEAR=0`."""
    from vllm import SamplingParams

    with monkeypatch.context() as env:
        if not o3_linear:
            env.setenv(cpu_bf16_linear.OPT_OUT, "0")
        with vllm_engine(
            checkpoint,
            dtype="bfloat16",
            enforce_eager=enforce_eager,
            enable_prefix_caching=False,
        ) as llm:
            greedy = SamplingParams(
                temperature=0, max_tokens=12, logprobs=5, ignore_eos=True
            )
            outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
            return llm.apply_model(kernel_linears)[0], vllm_generations(outputs)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_bfloat16_engines_take_it_where_torchs_gemm_is_a_loop(
    tiny_checkpoint, enforce_eager, monkeypatch
):
    """Compiled, the op is opaque to torch.compile (vLLM's full-graph trace
    would fail the start otherwise); against the same mode on torch's linear,
    as compiled and eager bfloat16 runs of this tiny model part early."""
    (taken, linears), o3 = bfloat16_run(
        tiny_checkpoint, enforce_eager, True, monkeypatch
    )
    (untaken, _), torch_ = bfloat16_run(
        tiny_checkpoint, enforce_eager, False, monkeypatch
    )
    # attention's, the light path's, the full FFN's and the head's
    assert linears >= 4 and untaken == 0
    if cpu_bf16_linear.pays() and cpu_bf16_linear.unavailable_reason() is None:
        assert taken == linears
    else:
        assert taken == 0
    check_logprobs_close(torch_, o3, "torch", "o3")
