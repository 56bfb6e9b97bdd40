"""y = x @ W^T for an `o3_int4` weight: the fastest correct kernel per platform
and batch size.

CPU, measured on this project's machines (docs/bench_int4_linear.md):
- the INT4 GEMM of `cpu_int4_gemm` (AVX512-BF16, or AVX2 with FMA): it reads
  4 bits per weight and expands them in registers once per tile of rows, so
  it is faster than a 16-bit GEMM at decode sizes. On AVX512-BF16 without
  AMX it stays about as fast as 16-bit up to thousands of rows. On AVX2,
  where oneDNN has no 16-bit GEMM and vLLM's 16-bit linears run torch's
  plain loop, it is several times faster than those, and from 192 rows it
  dequantizes the weight into float32 for torch's float32 GEMM. With AMX
  (Intel from Sapphire Rapids) vLLM's 16-bit GEMM runs on tiles and is many
  times faster from a few rows: there the same operation runs such calls on
  AMX tiles too, the weight expanded per call a pair of 16-channel blocks at
  a time (`cpu_int4_gemm.AMX_MIN_ROWS`), and calls of 1536 rows or more (640
  over 2048 inputs; none where a weight of 16 M values or more has 2048
  inputs or fewer) as the whole weight dequantized into a buffer and that
  16-bit GEMM.
  Either way from the 4-bit weight alone (half a byte per weight);
- where it cannot run (neither ISA, no compiler, activations not bfloat16:
  logged once), torch's own packed-INT4 matmul
  (`_weight_int4pack_mm_for_cpu`) up to `packed_max_rows` (fast at one row,
  but its cost grows with the rows) and above, the weight dequantized once per
  call into a buffer shared by all layers (one pass, compiled by torch) and
  a GEMM on it: 16-bit where torch has a oneDNN GEMM for the activations'
  dtype, else float32 (`gemm_dtype`). That holds the weight twice in 4 bits,
  one layout per path: 1 byte per weight, half of 16-bit.

GPUs: vLLM's mixed-precision kernel selection (`choose_mp_linear_kernel`:
Machete, Marlin, ..., its own Triton W4A16) on the checkpoint's GPTQ layout;
for a layer none of them takes (e.g. a symmetric weight whose output size is
not a multiple of 8), `int4_gemm_triton` on the same layout, logged.

`dequantize` (int4_format) is the reference every path is tested against.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.logger import init_logger

from vllm_o3.kernels import cpu_int4_gemm, cpu_kernels
from vllm_o3.quantization.int4_format import SYMMETRIC_ZERO, Int4Weight, unpack_int4

logger = init_logger(__name__)

# Crossover of torch's packed INT4 matmul and dequantize + GEMM for both FFN
# shapes of the 1b preset: between 32 and 48 rows with oneDNN's 16-bit GEMM
# (Intel Xeon), between 96 and 128 with the float32 one (AMD Zen 3), whose
# dequantization writes twice the bytes.
SMALL_M_MAX = 40
SMALL_M_MAX_FLOAT32_GEMM = 128
INNER_K_TILES = 2


# Nibble shifts of the two halves of a group in `pack_group_halves` layout.
HALF_SHIFTS = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)


def pack_group_halves(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] 4-bit values two to a byte: within each group, byte j holds
    k = j (low nibble) and k = j + group_size / 2 (high nibble), so that
    unpacking writes two contiguous runs per group and vectorizes (an
    interleaved layout makes torch.compile split it in two slower passes)."""
    n, k = q.shape
    halves = q.to(torch.uint8).view(n, k // group_size, 2, group_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def _dequantize_into(
    out: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    shifts: torch.Tensor,
) -> torch.Tensor:
    """out[n, k] = q[n, k] * scales[n, g] - offsets[n, g], g = k // group_size,
    q in `pack_group_halves` layout, scales and offsets in float32; one pass."""
    n, k = out.shape
    groups = scales.shape[1]
    halves = packed.view(n, groups, 1, k // groups // 2)
    q = ((halves >> shifts) & 15).to(torch.float32)
    w = q * scales.view(n, groups, 1, 1) - offsets.view(n, groups, 1, 1)
    return out.copy_(w.view(n, k))


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the dequantizing path multiplies in: float32 where torch has
    no fast GEMM for `dtype` (float32 is exact for every 4-bit weight times
    a 16-bit scale)."""
    return dtype if cpu_kernels.has_fast_gemm(dtype) else torch.float32


def packed_max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows of `dtype` torch's packed INT4 matmul runs."""
    if gemm_dtype(dtype) == torch.float32:
        return SMALL_M_MAX_FLOAT32_GEMM
    return SMALL_M_MAX


_compiled_dequantize_into = None
# One dequantization buffer per weight shape, shared by all layers: a model
# runs its layers one after another, so it never holds more than one copy.
_DENSE_BUFFERS: dict[tuple, torch.Tensor] = {}


def dense_buffer(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    key = (shape, dtype)
    if key not in _DENSE_BUFFERS:
        _DENSE_BUFFERS[key] = torch.empty(shape, dtype=dtype)
    return _DENSE_BUFFERS[key]


def compiled_dequantize_into():
    """`_dequantize_into` fused into one pass by torch.compile (built once;
    each weight shape compiles its own specialization)."""
    global _compiled_dequantize_into
    if _compiled_dequantize_into is None:
        _compiled_dequantize_into = torch.compile(
            _dequantize_into, dynamic=False, fullgraph=True
        )
    return _compiled_dequantize_into


@torch.library.custom_op("o3::int4_linear_cpu_packed", mutates_args=())
def int4_linear_cpu_packed(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale_zero: torch.Tensor,
    rows: torch.Tensor,
    row_scales: torch.Tensor,
    row_offsets: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Where our C++ kernel cannot run: torch's packed INT4 matmul up
    to `packed_max_rows`, dequantize + GEMM above. Chosen by the rows of each
    call, inside an operation opaque to torch.compile: traced inline, the
    choice would be fixed at the batch size vLLM compiles with."""
    if x.shape[0] <= packed_max_rows(x.dtype):
        return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_zero)
    dense = dense_buffer((rows.shape[0], rows.shape[1] * 2), gemm_dtype(x.dtype))
    compiled_dequantize_into()(dense, rows, row_scales, row_offsets, HALF_SHIFTS)
    return torch.nn.functional.linear(x.to(dense.dtype), dense).to(x.dtype)


@int4_linear_cpu_packed.register_fake
def _(x, packed, scale_zero, rows, row_scales, row_offsets, group_size):
    return x.new_empty(x.shape[0], rows.shape[0])


class Int4Linear(nn.Module):
    """One INT4 projection, ready to run; built from the checkpoint layout."""

    def __init__(
        self,
        weight: Int4Weight,
        dtype: torch.dtype,
        name: str = "",
        vllm_kernel: bool | None = None,
    ):
        """`vllm_kernel`: use vLLM's kernel selection; default on GPUs only
        (on the CPU it picks CPUWNA16, which benchmarks slower than ours)."""
        super().__init__()
        self.name = name
        self.group_size = weight.group_size
        self.in_features = weight.qweight.shape[0] * 8
        self.out_features = weight.qweight.shape[1]
        self.dtype = dtype
        if vllm_kernel is None:
            vllm_kernel = weight.qweight.device.type != "cpu"
        if vllm_kernel:
            self._init_vllm_kernel(weight)
        else:
            self._init_cpu(weight)

    # -- CPU ---------------------------------------------------------------

    def _init_cpu(self, weight: Int4Weight) -> None:
        scales = weight.scales.to(self.dtype)
        zeros = None if weight.qzeros is None else unpack_int4(weight.qzeros, dim=1)
        q = unpack_int4(weight.qweight, dim=0).t().contiguous()  # [N, K] values
        reason = (
            cpu_int4_gemm.unavailable_reason()
            if self.dtype == torch.bfloat16
            else f"activations are {self.dtype}, it takes bfloat16"
        )
        if reason is None:
            words, block_scales, block_offsets = cpu_int4_gemm.pack_for_gemm(
                q, scales, zeros
            )
            self.register_buffer("words", words, persistent=False)
            self.register_buffer("block_scales", block_scales, persistent=False)
            self.register_buffer("block_offsets", block_offsets, persistent=False)
            self.forward = self._forward_kernel
            return
        logger.warning_once(
            "o3_int4 on CPU: the C++ INT4 kernel is not used (%s); "
            "torch's packed INT4 matmul up to %d rows and dequantize + %s "
            "GEMM above run instead (docs/bench_int4_linear.md)",
            reason,
            packed_max_rows(self.dtype),
            str(gemm_dtype(self.dtype)).removeprefix("torch."),
        )
        zeros = (
            torch.full_like(scales, SYMMETRIC_ZERO)
            if zeros is None
            else zeros.to(self.dtype)
        )
        # torch's packed layout, with w = (q - 8) * scale + zero per group,
        # i.e. zero = (8 - z) * scale.
        self.register_buffer(
            "packed",
            torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INNER_K_TILES),
            persistent=False,
        )
        scale_zero = torch.stack([scales, (SYMMETRIC_ZERO - zeros) * scales], dim=-1)
        self.register_buffer("scale_zero", scale_zero.contiguous(), persistent=False)
        # Row-major by output, two to a byte: what the dequantizing path reads.
        self.register_buffer(
            "rows", pack_group_halves(q, self.group_size), persistent=False
        )
        # In float32, where q * scale - zero * scale is exact: the dequantized
        # weight is the reference's, rounded once.
        self.register_buffer(
            "row_scales", scales.float().t().contiguous(), persistent=False
        )
        self.register_buffer(
            "row_offsets",
            (zeros.float() * scales.float()).t().contiguous(),
            persistent=False,
        )
        self.forward = self._forward_torch_packed

    # Each path takes [tokens, in] rows; the 2-D contiguous x vLLM passes goes
    # through without a reshape, which costs an operator dispatch per call
    # (~10 us in eager mode with cold caches, as a decode step has them).
    def _rows_of(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(
                f"{self.name}: input is {x.dtype}, weights are {self.dtype}"
            )
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        return rows.contiguous()

    def _shaped_like(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.o3_cpu.int4_gemm(
            self._rows_of(x),
            self.words,
            self.block_scales,
            self.block_offsets,
            self.out_features,
            cpu_int4_gemm.AMX_MIN_ROWS,
        )
        return self._shaped_like(y, x)

    def _forward_torch_packed(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.o3.int4_linear_cpu_packed(
            self._rows_of(x),
            self.packed,
            self.scale_zero,
            self.rows,
            self.row_scales,
            self.row_offsets,
            self.group_size,
        )
        return self._shaped_like(y, x)

    # -- GPUs -----------------------------------------------------------------

    def _init_vllm_kernel(self, weight: Int4Weight) -> None:
        from vllm.model_executor.kernels.linear import choose_mp_linear_kernel
        from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
            MPLinearLayerConfig,
        )
        from vllm.model_executor.parameter import (
            GroupQuantScaleParameter,
            PackedvLLMParameter,
        )
        from vllm.scalar_type import scalar_types

        sym = weight.qzeros is None
        config = MPLinearLayerConfig(
            full_weight_shape=(self.in_features, self.out_features),
            partition_weight_shape=(self.in_features, self.out_features),
            weight_type=scalar_types.uint4b8 if sym else scalar_types.uint4,
            act_type=self.dtype,
            group_size=self.group_size,
            zero_points=not sym,
        )
        try:
            kernel_type = choose_mp_linear_kernel(config)
        except ValueError as no_kernel:
            logger.warning(
                "%s: vLLM has no mixed-precision kernel for this layer (%s); "
                "o3_int4's Triton W4A16 GEMM runs it (docs/bench_gpu_kernels.md)",
                self.name,
                str(no_kernel).replace("\n", " "),
            )
            self._init_triton(weight)
            return
        self.params = nn.Module()  # the parameter names vLLM's kernels expect
        self.params.weight_packed = PackedvLLMParameter(
            data=weight.qweight, input_dim=0, output_dim=1, packed_dim=0,
            packed_factor=8, weight_loader=None,
        )  # fmt: skip
        self.params.weight_scale = GroupQuantScaleParameter(
            data=weight.scales.to(self.dtype),
            input_dim=0,
            output_dim=1,
            weight_loader=None,
        )
        zero_name = None
        if not sym:
            self.params.weight_zero_point = PackedvLLMParameter(
                data=weight.qzeros, input_dim=0, output_dim=1, packed_dim=1,
                packed_factor=8, weight_loader=None,
            )  # fmt: skip
            zero_name = "weight_zero_point"
        self.params.bias = None
        self.kernel = kernel_type(config, "weight_packed", "weight_scale", zero_name)
        self.kernel.process_weights_after_loading(self.params)
        self.forward = lambda x: self.kernel.apply_weights(self.params, x)

    def _init_triton(self, weight: Int4Weight) -> None:
        from vllm_o3.kernels import int4_gemm_triton  # noqa: F401 (registers the op)

        self.register_buffer("qweight", weight.qweight, persistent=False)
        self.register_buffer("scales", weight.scales.to(self.dtype), persistent=False)
        self.register_buffer("qzeros", weight.qzeros, persistent=False)
        self.forward = self._forward_triton

    def _forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.o3.int4_gemm_triton(
            self._rows_of(x), self.qweight, self.scales, self.qzeros
        )
        return self._shaped_like(y, x)
