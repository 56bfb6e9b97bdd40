"""O3's RMSNorm on the CPU: the C++ kernel (vLLM's, or O3's for bfloat16 where
vLLM's rounds toward zero) against the reference model's norm (transformers'
Llama RMSNorm: w * x / sqrt(mean(x^2) + eps) in float32, rounded once), in
every dtype it takes, with and without the residual add; O3's kernel against
vLLM's native norm on every ISA; what the kernels cannot read runs natively
with the same result; and which forward an engine picks in eager and compiled
mode."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.utils import vllm_engine
from vllm_o3.kernels import cpu_kernels
from vllm_o3.model import layernorm
from vllm_o3.model.layernorm import RMSNormWithCpuKernel

EPS = 1e-5
TOLERANCE = {  # one rounding step of the dtype at |y| ~ 4
    torch.bfloat16: 3e-2,
    torch.float16: 4e-3,
    torch.float32: 1e-5,
}


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference model's norm: transformers' Llama RMSNorm."""
    reference = LlamaRMSNorm(weight.shape[0], eps=EPS)
    reference.weight.data = weight.detach().clone()
    with torch.no_grad():
        return reference(x)


def norm(width: int, dtype: torch.dtype) -> RMSNormWithCpuKernel:
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # custom ops read it at creation
        layer = RMSNormWithCpuKernel(width, eps=EPS, dtype=dtype)
    layer.weight.data.uniform_(0.5, 1.5)
    return layer


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("rows, width", [(1, 64), (37, 576), (5, 2048), (0, 64)])
def test_the_kernel_normalises_as_the_definition_says(rows, width, dtype):
    layer = norm(width, dtype)
    kernels, refusal = layer._cpu_kernels(torch.empty(1, width, dtype=dtype))
    if cpu_kernels.unavailable_reason() is not None and kernels is None:
        pytest.skip(refusal)  # bfloat16 where only O3's kernel takes it
    assert kernels is not None
    torch.manual_seed(rows + width)
    x = torch.randn(rows, width, dtype=dtype) * 3
    residual = torch.randn(rows, width, dtype=dtype)
    tolerance = dict(atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    torch.testing.assert_close(
        layer.forward_cpu(x), rms_norm_reference(x, layer.weight), **tolerance
    )

    summed = (x.float() + residual.float()).to(dtype)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = layer.forward_cpu(x_in, residual_in)
    assert torch.equal(new_residual, summed)
    torch.testing.assert_close(
        out, rms_norm_reference(summed, layer.weight), **tolerance
    )
    # In place, as vLLM's fused op is on GPUs: callers rebind both names.
    assert out.data_ptr() == x_in.data_ptr()
    assert new_residual.data_ptr() == residual_in.data_ptr()


def round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    return (x.float().view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()


def test_bfloat16_takes_o3s_kernel_where_vllms_rounds_toward_zero():
    from vllm import _custom_ops as ops

    torch.manual_seed(2)
    layer = norm(2048, torch.bfloat16)
    x = torch.randn(16, 2048, dtype=torch.bfloat16) * 3
    residual = torch.randn(16, 2048, dtype=torch.bfloat16)
    summed = x.float() + residual.float()
    kernel_residual = residual.clone()
    ops.fused_add_rms_norm(x.clone(), kernel_residual, layer.weight.data, EPS)
    kernels, refusal = layer._cpu_kernels(x, residual)
    if layernorm.BFLOAT16_ROUNDS_TO_NEAREST:
        assert (kernels, refusal) == (ops, None)
        assert torch.equal(kernel_residual, summed.bfloat16())
        return
    # What vLLM's kernel for this CPU does, and why it is not used: should a
    # vLLM release round to nearest here, this fails and its kernel can return.
    assert torch.equal(kernel_residual, round_toward_zero(summed))
    assert not torch.equal(kernel_residual, summed.bfloat16())
    assert refusal is None
    if cpu_kernels.unavailable_reason() is None:
        assert kernels is torch.ops.o3_cpu
    out, new_residual = layer.forward_cpu(x.clone(), residual.clone())
    assert torch.equal(new_residual, summed.bfloat16())
    torch.testing.assert_close(
        out, rms_norm_reference(summed.bfloat16(), layer.weight), atol=3e-2, rtol=3e-2
    )


def native_norm(x, residual, weight):
    """vLLM's native norm (its IR op's PyTorch definition), which O3's kernel
    computes with float32 sums in another order."""
    from vllm.ir.ops.layernorm import fused_add_rms_norm, rms_norm

    if residual is None:
        return rms_norm.impls["native"].impl_fn(x, weight, EPS, None)
    return fused_add_rms_norm.impls["native"].impl_fn(x, residual, weight, EPS, None)


needs_o3_kernels = pytest.mark.skipif(
    cpu_kernels.unavailable_reason() is not None,
    reason=str(cpu_kernels.unavailable_reason()),
)


@needs_o3_kernels
@pytest.mark.parametrize(
    "shape", [(1, 2048), (37, 576), (3, 5, 64), (4, 7), (2, 2047), (0, 64)]
)
def test_o3s_kernel_is_vllms_native_norm(shape, isa):
    torch.manual_seed(sum(shape))
    width = shape[-1]
    weight = torch.empty(width, dtype=torch.bfloat16).uniform_(0.5, 1.5)
    x = torch.randn(shape, dtype=torch.bfloat16) * 3
    residual = torch.randn(shape, dtype=torch.bfloat16)
    one_rounding = dict(atol=0, rtol=2**-7)  # the scale's float32 sum's order

    out = torch.empty_like(x)
    torch.ops.o3_cpu.rms_norm(out, x, weight, EPS)
    torch.testing.assert_close(out, native_norm(x, None, weight), **one_rounding)

    expected_out, expected_residual = native_norm(x, residual, weight)
    torch.ops.o3_cpu.fused_add_rms_norm(x, residual, weight, EPS)  # in place
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(x, expected_out, **one_rounding)


@needs_o3_kernels
@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(2, 8), torch.ones(8, dtype=torch.bfloat16)), "bfloat16 tensor"),
        ((torch.zeros(8, 2, dtype=torch.bfloat16).t(), torch.ones(8)), "contiguous"),
        ((torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(6)), "x's width 8"),
    ],
)
def test_o3s_kernel_refuses_what_it_cannot_read_by_name(args, message):
    x, weight = args
    with pytest.raises(RuntimeError, match=message):
        torch.ops.o3_cpu.rms_norm(
            torch.empty_like(x), x, weight.to(torch.bfloat16), EPS
        )


def test_without_o3s_kernels_bfloat16_runs_natively_and_says_why(monkeypatch):
    monkeypatch.setattr(layernorm, "BFLOAT16_ROUNDS_TO_NEAREST", False)
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "no compiler")
    layer = norm(64, torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    kernels, refusal = layer._cpu_kernels(x)
    assert kernels is None
    assert "rounds toward zero" in refusal and "no compiler" in refusal
    torch.testing.assert_close(layer.forward_cpu(x), layer.forward_native(x))


def test_a_rows_norm_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    layer = norm(2048, torch.bfloat16)
    x = torch.randn(16, 2048, dtype=torch.bfloat16)
    assert torch.equal(layer.forward_cpu(x)[5], layer.forward_cpu(x[5:6].clone())[0])


@pytest.mark.parametrize(
    "case, reason",
    [
        ("strided view", "strided"),
        ("width not a multiple of 8", "width 60"),
        ("weight dtype differs", "torch.float32 weight"),
    ],
)
def test_what_the_kernel_cannot_read_runs_natively_with_the_same_result(case, reason):
    torch.manual_seed(1)
    dtype, width = torch.bfloat16, 64
    x = torch.randn(6, 2 * width, dtype=dtype)[:, :width]  # strided
    if case == "width not a multiple of 8":
        width = 60
        x = torch.randn(6, width, dtype=dtype)
    layer = norm(width, torch.float32 if case == "weight dtype differs" else dtype)
    residual = torch.randn(6, width, dtype=dtype)

    assert reason in layer._cpu_kernels(x)[1]
    torch.testing.assert_close(layer.forward_cpu(x), layer.forward_native(x))
    expected = layer.forward_native(x.clone(), residual.clone())
    got = layer.forward_cpu(x.clone(), residual.clone())
    torch.testing.assert_close(got, expected)


def norm_forwards(model) -> set[str]:
    """Runs in the worker: the forward each of the model's norms dispatched to."""
    return {
        module._forward_method.__name__
        for module in model.modules()
        if isinstance(module, RMSNormWithCpuKernel)
    }


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_eager_engines_run_the_kernel_and_compiled_ones_let_inductor_fuse(
    tiny_checkpoint, enforce_eager
):
    with vllm_engine(tiny_checkpoint, enforce_eager=enforce_eager) as llm:
        expected = "forward_cpu" if enforce_eager else "forward_native"
        assert llm.apply_model(norm_forwards)[0] == {expected}
