"""The CPU routed FFN's C++ router and light path against their plain PyTorch
definition (`routing.router_scores_torch`, the light path as two bfloat16
linears, `routing.routed_ffn_torch`), on random odd shapes and heavy
fractions 0, partial and 1, in batches the fused kernel takes and batches
whose light rows go to the light path's GEMM; and a bfloat16 engine that
runs it, against the same engine on the PyTorch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.utils import PROMPTS, check_logprobs_close, vllm_engine, vllm_generations
from vllm_o3.kernels import cpu_kernels, cpu_routed_ffn
from vllm_o3.kernels.routing import (
    on_rows,
    routed_ffn_torch,
    router_scores_torch,
    row_bucket,
)
from vllm_o3.model.router_trace import routed_layers, router_counts

SHAPES = [  # (T, H, light_rank, router_hidden)
    (1, 64, 8, 16),
    (7, 96, 13, 24),
    (33, 128, 16, 64),
    (70, 80, 10, 100),
    (5, 576, 72, 64),
    (40, 576, 72, 64),
]
assert (
    min(t for t, *_ in SHAPES)
    < cpu_routed_ffn.FUSED_MAX_ROWS
    < max(t for t, *_ in SHAPES)
), "the shapes must cover both the fused kernel and the router + light GEMM"


def test_the_kernel_runs_on_the_best_isa_the_cpu_has():
    # Not a silent fallback: on a CPU with AVX512-BF16, or else AVX2 and FMA,
    # the kernel must build and run on it.
    reason = cpu_routed_ffn.unavailable_reason(torch.bfloat16, 576)
    flags = Path("/proc/cpuinfo").read_text().split()
    if "avx512_bf16" in flags:
        assert reason is None
        assert torch.ops.o3_cpu.kernel_isa() == "avx512_bf16"
    elif "avx2" in flags and "fma" in flags:
        assert reason is None
        assert torch.ops.o3_cpu.kernel_isa() == "avx2"
    else:
        assert "neither AVX512-BF16 nor AVX2" in reason


def test_it_says_why_it_does_not_take_a_layer():
    assert "float32" in cpu_routed_ffn.unavailable_reason(torch.float32, 576)
    assert "not a multiple of 16" in cpu_routed_ffn.unavailable_reason(
        torch.bfloat16, 100
    )


def test_row_buckets_are_few_and_tight():
    assert [row_bucket(n) for n in range(17)] == list(range(17))  # decode sizes
    for n in range(17, 20_000):
        assert n <= row_bucket(n) < n + n / 16
        assert row_bucket(row_bucket(n)) == row_bucket(n)
    assert len({row_bucket(n) for n in range(4097, 8193)}) == 16  # per doubling


def test_a_padded_gather_gives_each_row_its_own_output():
    u = torch.randn(300, 8)
    rows = torch.randperm(300)[:77]
    sizes = []

    def twice(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.shape[0])
        return x * 2

    torch.testing.assert_close(on_rows(u, rows, twice), u[rows] * 2)
    assert sizes == [row_bucket(77)] and row_bucket(77) > 77


needs_kernel = pytest.mark.skipif(
    cpu_routed_ffn.unavailable_reason(torch.bfloat16, 64) is not None,
    reason=str(cpu_routed_ffn.unavailable_reason(torch.bfloat16, 64)),
)
ISAS = cpu_kernels.isas()


class Layer:
    def __init__(self, H: int, r: int, R: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5

        self.fc1_weight = randn(R, H, scale=2.0)
        self.fc1_bias = randn(R)
        self.fc2_weight = randn(1, R, scale=4.0)
        self.fc2_bias = randn(1)
        self.light_down = randn(r, H).bfloat16()
        self.light_up = randn(H, r).bfloat16()
        self.gate = randn(2 * H, H).bfloat16()

    def router(self, u: torch.Tensor) -> torch.Tensor:
        return router_scores_torch(
            u, self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias
        )

    def light(self, u: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(u, self.light_down), self.light_up)

    def heavy(self, u: torch.Tensor) -> torch.Tensor:
        return F.linear(u, self.gate)[:, : u.shape[1]]

    def packed(self) -> cpu_routed_ffn.CpuRoutedWeights:
        return cpu_routed_ffn.pack_routed_weights(
            self.fc1_weight,
            self.fc1_bias,
            self.fc2_weight,
            self.fc2_bias,
            self.light_down,
            self.light_up,
        )


def threshold_between(scores: torch.Tensor, fraction: float) -> float:
    """Midway between two scores, so that last-bit differences between the
    kernel's float32 sums and the library's cannot flip a row."""
    ranked = scores.sort(descending=True).values.tolist()
    heavy = round(fraction * len(ranked))
    if heavy == 0:
        return ranked[0] + 1e-3
    if heavy == len(ranked):
        return ranked[-1] - 1e-3
    return (ranked[heavy - 1] + ranked[heavy]) / 2


@needs_kernel
@pytest.mark.parametrize("fraction", [0.0, 0.4, 1.0])
@pytest.mark.parametrize(("T", "H", "r", "R"), SHAPES)
def test_routed_ffn_matches_its_pytorch_definition(T, H, r, R, fraction, isa):
    layer = Layer(H, r, R, seed=T)
    u = torch.randn(T, H).bfloat16()
    want_scores = layer.router(u)
    threshold = threshold_between(want_scores, fraction)
    want, want_heavy = routed_ffn_torch(
        u, want_scores, threshold, layer.heavy, layer.light
    )
    counts = torch.tensor([3, 5])
    got, scores, num_heavy = cpu_routed_ffn.routed_ffn_cpu(
        u, layer.packed(), threshold, layer.heavy, layer.light, counts
    )
    torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-6)
    assert num_heavy == want_heavy == round(fraction * T)
    assert counts.tolist() == [3 + num_heavy, 5 + T]
    # Same bfloat16 roundings (inputs, the rank-r intermediate, the output);
    # only the float32 summation order differs.
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)


@needs_kernel
def test_without_counts_nothing_is_counted_and_all_light_rows_are_written(isa):
    layer = Layer(64, 8, 16)
    u = torch.randn(64, 9).bfloat16().t()  # not contiguous
    y, _, num_heavy = cpu_routed_ffn.routed_ffn_cpu(
        u, layer.packed(), 2.0, layer.heavy, layer.light
    )
    assert num_heavy == 0
    torch.testing.assert_close(y, layer.light(u), rtol=0.02, atol=0.02)


@needs_kernel
def test_a_tokens_score_does_not_depend_on_its_batch(isa):
    # Rows are scored in tiles; a row's sums must not depend on its tile, or
    # a token could change path with the batch it was scheduled in.
    layer = Layer(128, 16, 64)
    packed = layer.packed()
    u = torch.randn(23, 128).bfloat16()
    args = (packed.w1t, packed.b1, packed.w2, packed.b2, 0.5, None)
    batch = torch.ops.o3_cpu.route(u, *args)[0]
    for row in (0, 5, 22):
        alone = torch.ops.o3_cpu.route(u[row : row + 1], *args)[0]
        assert alone.item() == batch[row].item()
    shifted = torch.ops.o3_cpu.route(u[3:], *args)[0]
    assert torch.equal(shifted, batch[3:])


@needs_kernel
def test_a_bad_weight_is_refused_by_name():
    layer = Layer(64, 8, 16)
    packed = layer.packed()
    packed.up = cpu_routed_ffn.pack_pairs(torch.zeros(32, 8).bfloat16()).view(
        torch.int16
    )
    with pytest.raises(RuntimeError, match="routed_light: up holds"):
        cpu_routed_ffn.routed_ffn_cpu(
            torch.randn(2, 64).bfloat16(), packed, 0.5, layer.heavy, layer.light
        )


@needs_kernel
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_its_registration_and_fake_agree_with_it(fraction):
    """torch.library's own checks: the schema (counts mutated in place), the
    fake's outputs (data-dependent row counts) against the real ones, and the
    ops traced as torch.compile would, where every output value is defined
    (routed_light's split leaves the heavy rows of y for the caller)."""
    layer = Layer(64, 8, 16)
    u = torch.randn(6, 64).bfloat16()
    packed = layer.packed()
    threshold = threshold_between(layer.router(u), fraction)
    args = (u, packed.w1t, packed.b1, packed.w2, packed.b2, packed.down, packed.up)
    checks = ["test_schema", "test_autograd_registration", "test_faketensor"]
    if fraction in (0.0, 1.0):
        checks.append("test_aot_dispatch_dynamic")
    torch.library.opcheck(
        torch.ops.o3_cpu.routed_light.default,
        (*args, packed.rank, threshold, torch.zeros(2, dtype=torch.int64)),
        test_utils=checks,
    )
    # route's outputs are all defined: every check, the traced one included.
    torch.library.opcheck(
        torch.ops.o3_cpu.route.default,
        (*args[:5], threshold, torch.zeros(2, dtype=torch.int64)),
    )


@needs_kernel
@pytest.mark.parametrize(("rows", "width"), [(1, 16), (3, 37), (9, 1030), (2, 5632)])
def test_silu_and_mul_is_silu_of_gate_times_up_rounded_once(rows, width, isa):
    """Against silu(gate) * up in float32 rounded to bfloat16 (as inductor
    fuses vLLM's SiluAndMul), at widths with and without a partial vector and
    gates far out on both sides (exp saturates there)."""
    g = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, 2 * width, generator=g) * 4).bfloat16()
    x[0, :4] = torch.tensor([-120.0, -30.0, 30.0, 120.0])
    expected = (F.silu(x[:, :width].float()) * x[:, width:].float()).bfloat16()
    got = cpu_routed_ffn.CpuSiluAndMul()(x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # exp to ~2 float32 ulp: a rounding flips to the neighbouring bfloat16 at
    # most; where exp(-gate) overflows, 0 against the kernel's ~1e-36.
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-30)
    in_range = x[:, :width].abs() < 80
    assert (got == expected)[in_range].float().mean() > 0.999
    torch.library.opcheck(torch.ops.o3_cpu.silu_and_mul.default, (x,))


@pytest.mark.skipif(len(ISAS) < 2, reason="the kernels run on one ISA here")
def test_every_isa_routes_alike():
    """Router scores and the activation are the same float32 operations in
    the same order on every ISA (sums in _mm512_reduce_add_ps's order): the
    same bits, so a token takes the same path on either CPU. The light path
    does VDPBF16PS's two adds as two FMAs in the order Intel documents; the
    bfloat16 outputs may differ in their last bit only if hardware adds
    otherwise."""
    layer = Layer(576, 72, 64)
    packed = layer.packed()
    u = torch.randn(7, 576).bfloat16()
    x = (torch.randn(5, 2 * 1030) * 4).bfloat16()
    results = []
    for isa in ISAS:
        with cpu_kernels.using_isa(isa):
            y, scores, heavy_rows = torch.ops.o3_cpu.routed_light(
                u, packed.w1t, packed.b1, packed.w2, packed.b2,
                packed.down, packed.up, packed.rank, 2.0, None,
            )  # fmt: skip
            results.append((y, scores, torch.ops.o3_cpu.silu_and_mul(x)))
    assert heavy_rows.numel() == 0  # every row light: y is the light path
    for y, scores, activation in results[1:]:
        assert torch.equal(scores, results[0][1])
        assert torch.equal(activation, results[0][2])
        torch.testing.assert_close(y, results[0][0], rtol=2**-8, atol=0)


def test_an_isa_the_cpu_lacks_is_refused():
    if cpu_kernels.unavailable_reason() is not None:
        pytest.skip(cpu_kernels.unavailable_reason())
    with pytest.raises(RuntimeError, match="unknown ISA 'sse2'"):
        torch.ops.o3_cpu.use_isa("sse2")
    if "avx512_bf16" not in ISAS:
        with pytest.raises(RuntimeError, match="this CPU has no avx512_bf16"):
            torch.ops.o3_cpu.use_isa("avx512_bf16")
    assert torch.ops.o3_cpu.kernel_isa() == ISAS[0]


@needs_kernel
def test_silu_and_mul_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="x's width 7 is odd"):
        torch.ops.o3_cpu.silu_and_mul(torch.zeros(2, 7).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous 2-D bfloat16"):
        torch.ops.o3_cpu.silu_and_mul(torch.zeros(2, 8))


def kernel_layers(model) -> list[bool]:
    """Runs in the worker: which routed layers the C++ kernels run."""
    return [
        layer.cpu_weights is not None
        and isinstance(layer.mlp.act_fn, cpu_routed_ffn.CpuSiluAndMul)
        for _, layer in routed_layers(model)
    ]


class TorchSiluAndMul(torch.nn.Module):
    """vLLM's PyTorch definition of the activation, uncompiled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.model_executor.layers.activation import SiluAndMul

        return SiluAndMul.forward_native(x)


def drop_kernel(model) -> None:
    """Runs in the worker: sends every routed layer to the PyTorch path."""
    for _, layer in routed_layers(model):
        layer.cpu_weights = None
        layer.mlp.act_fn = TorchSiluAndMul()


@pytest.fixture(scope="module")
def bfloat16_runs(tiny_checkpoint):
    """One bfloat16 engine generating with the kernel, then with the PyTorch
    path: (layers the kernel ran, generations, router counts of the run)."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    runs = {}
    with vllm_engine(
        tiny_checkpoint,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,  # both runs compute every prompt token
    ) as llm:
        for path in ("kernel", "pytorch"):
            if path == "pytorch":
                llm.apply_model(drop_kernel)
            before = llm.apply_model(router_counts)[0]
            generations = vllm_generations(
                llm.generate(PROMPTS, greedy, use_tqdm=False)
            )
            after = llm.apply_model(router_counts)[0]
            counts = {
                index: (after[index][0] - heavy, after[index][1] - real)
                for index, (heavy, real) in before.items()
            }
            runs[path] = (llm.apply_model(kernel_layers)[0], generations, counts)
    return runs


@needs_kernel
def test_a_bfloat16_engine_runs_the_kernel_and_generates_as_pytorch_does(
    bfloat16_runs,
):
    kernel_used, kernel, kernel_counts = bfloat16_runs["kernel"]
    pytorch_used, pytorch, pytorch_counts = bfloat16_runs["pytorch"]
    assert kernel_used and all(kernel_used) and not any(pytorch_used)
    check_logprobs_close(pytorch, kernel, "pytorch", "kernel")
    assert kernel_counts.keys() == pytorch_counts.keys()
    for index, (heavy, real) in kernel_counts.items():
        # Same tokens computed; once greedy paths part, the heavy share may too.
        assert real == pytorch_counts[index][1] > 0
        assert 0 < heavy < real
        assert abs(heavy - pytorch_counts[index][0]) <= 0.1 * real
