"""The routed-FFN kernels against their plain PyTorch definitions.

On a machine without a GPU they run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1); with one, natively. Shapes are random and odd-sized; heavy
fractions cover none, some and all of the rows, plus CUDA-graph padding rows.
"""

from __future__ import annotations

import pytest
import torch

from vllm_o3.kernels.routed_ffn_triton import RoutedFFNWeights, routed_ffn_triton
from vllm_o3.kernels.routed_gemm import (
    gather_gemm,
    gather_gemm_reference,
    scatter_gemm,
    scatter_gemm_reference,
)
from vllm_o3.kernels.router import route_rows
from vllm_o3.kernels.routing import (
    HEAVY,
    LIGHT,
    PADDING,
    partition_rows,
    routed_ffn_torch,
    router_scores_torch,
    routes_torch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [  # (T, H, I, light_rank, router_hidden)
    (1, 64, 96, 8, 16),
    (7, 96, 160, 12, 24),
    (33, 128, 192, 16, 64),
    (70, 80, 112, 10, 20),
]


def make_weights(H, I, r, R, dtype, seed=0) -> RoutedFFNWeights:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=dtype, scale=1.0):
        t = torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5
        return t.to(dtype).to(DEVICE)

    return RoutedFFNWeights(
        fc1_weight=randn(R, H, dtype=torch.float32, scale=2.0),
        fc1_bias=randn(R, dtype=torch.float32),
        fc2_weight=randn(1, R, dtype=torch.float32, scale=4.0),
        fc2_bias=torch.zeros(1, device=DEVICE),
        gate_up=randn(2 * I, H),
        down=randn(H, I),
        light_down=randn(r, H),
        light_up=randn(H, r),
    )


def threshold_for(scores: torch.Tensor, heavy_fraction: float) -> float:
    """A threshold that sends about `heavy_fraction` of the rows heavy."""
    if heavy_fraction == 0.0:
        return 1.5
    if heavy_fraction == 1.0:
        return 0.0
    return float(scores.float().quantile(1 - heavy_fraction))


@pytest.mark.parametrize("T, H, I, r, R", [*SHAPES, (300, 64, 96, 8, 40)])
@pytest.mark.parametrize("padding", [0, 3])
def test_route_rows_equals_torch(T, H, I, r, R, padding):
    w = make_weights(H, I, r, R, torch.bfloat16)
    u = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    is_padding = torch.arange(T, device=DEVICE) >= T - padding if padding else None
    expected = router_scores_torch(
        u, w.fc1_weight, w.fc1_bias, w.fc2_weight, w.fc2_bias
    )
    ranked = expected.sort().values
    k = T // 2  # a threshold between two scores: about half the rows heavy
    threshold = float(ranked[0] - 1e-3 if k == 0 else (ranked[k - 1] + ranked[k]) / 2)
    scores, route, order, marks = route_rows(
        u, w.fc1_weight, w.fc1_bias, w.fc2_weight, w.fc2_bias, threshold, is_padding
    )
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    want_route = routes_torch(expected, threshold, is_padding)
    clear = (expected - threshold).abs() > 1e-6
    assert torch.equal(route[clear], want_route[clear])
    if not bool(clear.all()):  # a score on the threshold: either side is right
        want_route = route
    want_order, want_bounds = partition_rows(want_route)
    assert marks.tolist() == [0, *want_bounds.tolist()]
    num_heavy = int(want_bounds[0])
    assert torch.equal(order[:num_heavy], want_order[:num_heavy])


def test_partition_groups_heavy_then_light_then_padding():
    route = torch.tensor(
        [LIGHT, HEAVY, PADDING, HEAVY, LIGHT, LIGHT, PADDING], dtype=torch.int8
    )
    order, bounds = partition_rows(route)
    assert order.tolist() == [1, 3, 0, 4, 5, 2, 6]
    assert bounds.tolist() == [2, 5]


@pytest.mark.parametrize("T, H, I, r, R", SHAPES)
@pytest.mark.parametrize("swiglu", [False, True])
def test_gather_gemm_equals_torch(T, H, I, r, R, swiglu):
    w = make_weights(H, I, r, R, torch.float32)
    x = torch.randn(T, H, device=DEVICE)
    order = torch.randperm(T, device=DEVICE)
    start = torch.tensor([T // 3], device=DEVICE)
    end = torch.tensor([T], device=DEVICE)
    weight = w.gate_up if swiglu else w.light_down
    got = gather_gemm(x, order, start, end, weight, swiglu=swiglu)
    want = gather_gemm_reference(x, order, start, end, weight, swiglu=swiglu)
    n = T - T // 3
    torch.testing.assert_close(got[:n], want[:n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T, H, I, r, R", SHAPES)
def test_scatter_gemm_writes_only_its_rows(T, H, I, r, R):
    w = make_weights(H, I, r, R, torch.float32)
    a = torch.randn(T, I, device=DEVICE)
    order = torch.randperm(T, device=DEVICE)
    start, end = (
        torch.tensor([0], device=DEVICE),
        torch.tensor([(T + 1) // 2], device=DEVICE),
    )
    got = torch.full((T, H), 7.0, device=DEVICE)
    want = got.clone()
    scatter_gemm(a, order, start, end, w.down, got)
    scatter_gemm_reference(a, order, start, end, w.down, want)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [2, 3])
def test_scatter_gemm_split_k_parts_sum_to_the_product(splits):
    T, H, I = 9, 96, 320  # 5 blocks of K: the last part is shorter
    w = make_weights(H, I, 8, 16, torch.float32)
    a = torch.randn(T, I, device=DEVICE)
    order = torch.randperm(T, device=DEVICE)
    start, end = torch.tensor([2], device=DEVICE), torch.tensor([8], device=DEVICE)
    parts = torch.zeros(splits, T, H, device=DEVICE)
    scatter_gemm(a, order, start, end, w.down, parts)
    want = torch.zeros(T, H, device=DEVICE)
    scatter_gemm_reference(a, order, start, end, w.down, want)
    torch.testing.assert_close(parts.sum(0), want, atol=1e-4, rtol=1e-4)
    assert all(torch.count_nonzero(part) > 0 for part in parts)


@pytest.mark.parametrize("T, H, I, r, R", SHAPES)
@pytest.mark.parametrize("heavy_fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_ffn_triton_equals_torch(T, H, I, r, R, heavy_fraction, dtype):
    w = make_weights(H, I, r, R, dtype)
    u = torch.randn(T, H, device=DEVICE).to(dtype)
    scores = router_scores_torch(u, w.fc1_weight, w.fc1_bias, w.fc2_weight, w.fc2_bias)
    threshold = threshold_for(scores, heavy_fraction)

    def heavy_ffn(x):
        gate, up = (x.float() @ w.gate_up.float().t()).chunk(2, dim=-1)
        return (
            (torch.nn.functional.silu(gate) * up).to(dtype).float() @ w.down.float().t()
        ).to(dtype)

    def light_path(x):
        return (
            (x.float() @ w.light_down.float().t()).to(dtype).float()
            @ w.light_up.float().t()
        ).to(dtype)

    want, want_heavy = routed_ffn_torch(u, scores, threshold, heavy_ffn, light_path)
    got, got_scores, bounds = routed_ffn_triton(u, w, threshold)
    clear = (scores - threshold).abs() > 1e-5
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[clear], want[clear], atol=tol, rtol=tol)
    assert int(bounds[1]) == T
    if bool(clear.all()):
        assert int(bounds[0]) == want_heavy


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_routed_ffn_triton_replays_in_a_cuda_graph():
    """Captured once, replayed on new tokens, routes and padding: every replay
    computes that batch's own split, and padding rows count as neither."""
    T, H, I, r, R = 48, 128, 192, 16, 64
    w = make_weights(H, I, r, R, torch.bfloat16)
    threshold = 0.5
    u = torch.zeros(T, H, device=DEVICE, dtype=torch.bfloat16)
    is_padding = torch.zeros(T, dtype=torch.bool, device=DEVICE)
    routed_ffn_triton(u, w, threshold, is_padding)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, scores, bounds = routed_ffn_triton(u, w, threshold, is_padding)
    for real in (48, 40, 17, 1):
        u.copy_(torch.randn(T, H, device=DEVICE) * 2)
        is_padding.copy_(torch.arange(T, device=DEVICE) >= real)
        graph.replay()
        want, _, want_bounds = routed_ffn_triton(u[:real].clone(), w, threshold)
        assert bounds.tolist() == [int(want_bounds[0]), real]
        torch.testing.assert_close(y[:real], want, atol=1e-2, rtol=1e-2)
        assert torch.count_nonzero(y[real:]) == 0


def test_routed_ffn_triton_skips_and_zeroes_padding_rows():
    T, H, I, r, R = 20, 64, 96, 8, 16
    w = make_weights(H, I, r, R, torch.float32)
    u = torch.randn(T, H, device=DEVICE)
    is_padding = torch.arange(T, device=DEVICE) >= 15
    y, _, bounds = routed_ffn_triton(u, w, threshold=0.0, is_padding=is_padding)
    assert bounds.tolist() == [15, 15]  # all real rows heavy, padding not counted
    assert torch.count_nonzero(y[15:]) == 0
    full, _, _ = routed_ffn_triton(u[:15], w, threshold=0.0)
    torch.testing.assert_close(y[:15], full, atol=1e-5, rtol=1e-5)


def test_all_reduce_sums_only_the_heavy_part():
    T, H, I, r, R = 16, 64, 96, 8, 16
    w = make_weights(H, I, r, R, torch.float32)
    u = torch.randn(T, H, device=DEVICE)
    scores = router_scores_torch(u, w.fc1_weight, w.fc1_bias, w.fc2_weight, w.fc2_bias)
    threshold = threshold_for(scores, 0.5)
    single, _, _ = routed_ffn_triton(u, w, threshold)
    doubled, _, _ = routed_ffn_triton(u, w, threshold, all_reduce=lambda y: 2 * y)
    heavy = scores >= threshold
    torch.testing.assert_close(doubled[heavy], 2 * single[heavy])
    torch.testing.assert_close(doubled[~heavy], single[~heavy])
