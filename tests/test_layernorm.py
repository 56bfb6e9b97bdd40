"""O3's RMSNorm on the CPU: vLLM's C++ kernel against the reference model's
norm (transformers' Llama RMSNorm: w * x / sqrt(mean(x^2) + eps) in float32,
rounded once), in every dtype it takes, with and without the residual add;
what it cannot read runs natively with the same result; and which forward an
engine picks in eager and compiled mode."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.utils import vllm_engine
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
    if dtype == torch.bfloat16 and not layernorm.BFLOAT16_ROUNDS_TO_NEAREST:
        pytest.skip("the kernel does not take bfloat16 here (the test below)")
    torch.manual_seed(rows + width)
    layer = norm(width, dtype)
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


def test_bfloat16_runs_natively_where_the_kernel_rounds_toward_zero():
    from vllm import _custom_ops as ops

    torch.manual_seed(2)
    layer = norm(2048, torch.bfloat16)
    x = torch.randn(16, 2048, dtype=torch.bfloat16) * 3
    residual = torch.randn(16, 2048, dtype=torch.bfloat16)
    summed = x.float() + residual.float()
    kernel_residual = residual.clone()
    ops.fused_add_rms_norm(x.clone(), kernel_residual, layer.weight.data, EPS)
    refusal = layer._cpu_kernel_refusal(x, residual)
    if layernorm.BFLOAT16_ROUNDS_TO_NEAREST:
        assert refusal is None
        assert torch.equal(kernel_residual, summed.bfloat16())
        return
    # What vLLM's kernel for this CPU does, and why it is not used: should a
    # vLLM release round to nearest here, this fails and the kernel can return.
    assert torch.equal(kernel_residual, round_toward_zero(summed))
    assert not torch.equal(kernel_residual, summed.bfloat16())
    assert "rounds toward zero" in refusal
    out, new_residual = layer.forward_cpu(x.clone(), residual.clone())
    assert torch.equal(new_residual, summed.bfloat16())
    torch.testing.assert_close(
        out, rms_norm_reference(summed.bfloat16(), layer.weight), atol=3e-2, rtol=3e-2
    )


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

    assert reason in layer._cpu_kernel_refusal(x)
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
