"""The Triton W4A16 GEMM against the dequantized reference.

On a machine without a GPU it runs in Triton's interpreter (conftest sets
TRITON_INTERPRET=1); with one, natively. Shapes are odd-sized (outputs not a
multiple of the tile, one row, rows past a tile), both zero-point kinds, every
group size, K split across programs or not.
"""

from __future__ import annotations

import pytest
import torch

from vllm_o3.kernels.int4_gemm_triton import TileConfig, int4_gemm
from vllm_o3.kernels.triton_tiles import num_splits
from vllm_o3.quantization.int4_format import Int4Weight, dequantize, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_int4(n: int, k: int, group_size: int, sym: bool, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) / k**0.5
    packed = quantize(weight, group_size, sym)
    return Int4Weight(
        qweight=packed.qweight.to(DEVICE),
        scales=packed.scales.to(dtype).to(DEVICE),
        qzeros=None if sym else packed.qzeros.to(DEVICE),
    )


def assert_equals_dequantized(got: torch.Tensor, x: torch.Tensor, w: Int4Weight):
    # The kernel rounds each dequantized weight to x's dtype, as this does.
    want = x.float() @ dequantize(w, x.dtype).float().t()
    assert got.dtype == x.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "rows, n, k, group_size, sym",
    [
        (1, 96, 256, 128, True),
        (1, 200, 384, 64, False),
        (5, 96, 256, 32, False),
        (17, 136, 256, 64, True),
        (70, 96, 128, 32, True),
        (70, 200, 256, 128, False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_gemm_equals_dequantized_matmul(rows, n, k, group_size, sym, dtype):
    w = random_int4(n, k, group_size, sym, dtype)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    assert_equals_dequantized(int4_gemm(x, w.qweight, w.scales, w.qzeros), x, w)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_splitting_k_gives_the_same_product(splits):
    w = random_int4(64, 512, 64, False, torch.bfloat16, seed=1)
    x = torch.randn(3, 512, device=DEVICE).to(torch.bfloat16)
    config = TileConfig(16, 32, 64, 4, 2)
    got = int4_gemm(x, w.qweight, w.scales, w.qzeros, config=config, splits=splits)
    assert_equals_dequantized(got, x, w)


def test_splits_fill_the_multiprocessors_but_keep_four_k_blocks_each():
    assert num_splits(tiles=176, k_blocks=16, multiprocessors=132) == 2
    assert num_splits(tiles=32, k_blocks=44, multiprocessors=132) == 9
    assert num_splits(tiles=32, k_blocks=8, multiprocessors=132) == 2
    assert num_splits(tiles=512, k_blocks=64, multiprocessors=132) == 1


def test_a_weight_for_another_input_size_is_refused():
    w = random_int4(64, 256, 64, True, torch.bfloat16)
    x = torch.randn(2, 128, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="input has 128 features, .* takes 256"):
        int4_gemm(x, w.qweight, w.scales, w.qzeros)


def test_the_operation_compiles_opaque_and_equals_eager():
    w = random_int4(96, 256, 64, True, torch.bfloat16, seed=2)
    x = torch.randn(9, 256, device=DEVICE).to(torch.bfloat16)

    def fn(x):
        return torch.ops.o3.int4_gemm_triton(x, w.qweight, w.scales, w.qzeros) * 2

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), fn(x))
    assert_equals_dequantized(fn(x) / 2, x, w)


def test_a_layer_vllm_has_no_kernel_for_runs_the_triton_gemm(caplog):
    """An output size that is not a multiple of 8 leaves vLLM's selection
    without a kernel (its CPU kernels need multiples of 32, its GPU ones of 8
    or 64); the layer runs on the Triton GEMM and says so."""
    pytest.importorskip("vllm")
    from vllm_o3.kernels.int4_linear import Int4Linear

    w = random_int4(100, 256, 64, True, torch.bfloat16, seed=3)
    with caplog.at_level("WARNING"):
        linear = Int4Linear(w, torch.bfloat16, name="layers.3.mlp.down_proj",
                            vllm_kernel=True)  # fmt: skip
    assert "layers.3.mlp.down_proj: vLLM has no mixed-precision kernel" in caplog.text
    x = torch.randn(2, 5, 256, device=DEVICE).to(torch.bfloat16)
    got = linear(x)
    assert got.shape == (2, 5, 100)
    assert_equals_dequantized(got.reshape(10, 100), x.reshape(10, 256), w)
