"""The Triton kernels on a GPU: the routed FFN layer vs the dense FFN, and the
W4A16 GEMM vs the 16-bit GEMM, side by side in one run.

Every timing is a CUDA graph of `--calls` back-to-back calls, each on its own
copy of the weights (together several times the L2 cache, as in a model's
forward pass where each layer's weights come from memory), replayed
`--repeats` times; the median replay over the calls is reported. Each kernel
is checked against its PyTorch reference on the same inputs first.

    python -m benchmarks.gpu_kernels [--repeats 20] [--calls 20] [--parts ffn gemm tiles]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmarks.common import write_report
from benchmarks.routed_ffn_layer import threshold_for
from vllm_o3.kernels import routed_gemm
from vllm_o3.kernels.int4_gemm_triton import TileConfig, int4_gemm, tile_config
from vllm_o3.kernels.routed_ffn_triton import RoutedFFNWeights, routed_ffn_triton
from vllm_o3.kernels.routed_gemm import Tiles
from vllm_o3.kernels.routing import router_scores_torch
from vllm_o3.quantization.int4_format import Int4Weight, dequantize, quantize

L2_MULTIPLE_BYTES = 256 * 2**20  # what the weight copies of one timing span
FFN_SHAPES = {  # hidden, intermediate, light rank, router hidden
    "1b": (2048, 5632, 256, 64),
    "8b": (4096, 14336, 512, 64),
}
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
TOKENS = (1, 16, 512)
GEMM_ROWS = (1, 8, 16, 64, 512, 2048)
GROUP_SIZE = 128
CANDIDATES = {  # tile configs tried beside the default, by rows
    "small": [TileConfig(16, 128, 128, 4, 4), TileConfig(16, 32, 128, 2, 4)],
    "medium": [TileConfig(64, 128, 64, 4, 3), TileConfig(32, 64, 128, 4, 4)],
    "large": [TileConfig(128, 256, 64, 8, 3), TileConfig(64, 128, 64, 4, 4)],
}


def graph_time(calls: list[Callable[[], object]], repeats: int) -> float:
    """Median seconds per call of a CUDA graph running `calls` in turn."""
    for call in calls[:2]:
        call()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times)


def cycled(fn: Callable, weights: list, n: int) -> list[Callable[[], object]]:
    """`n` calls of `fn`, each on the next weight copy."""
    return [functools.partial(fn, weights[i % len(weights)]) for i in range(n)]


def copies_for(nbytes: int, calls: int) -> int:
    return max(2, min(calls, math.ceil(L2_MULTIPLE_BYTES / nbytes)))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def to_int4(weight: torch.Tensor, sym: bool = True) -> Int4Weight:
    packed = quantize(weight.float(), GROUP_SIZE, sym)
    return Int4Weight(packed.qweight, packed.scales.to(weight.dtype), packed.qzeros)


def clone(weight: torch.Tensor | Int4Weight) -> torch.Tensor | Int4Weight:
    if isinstance(weight, Int4Weight):
        z = weight.qzeros
        return Int4Weight(
            weight.qweight.clone(),
            weight.scales.clone(),
            None if z is None else z.clone(),
        )
    return weight.clone()


def tensor_bytes(weight: torch.Tensor | Int4Weight) -> int:
    if isinstance(weight, Int4Weight):
        parts = [weight.qweight, weight.scales, weight.qzeros]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)
    return weight.numel() * weight.element_size()


# -- W4A16 GEMM ----------------------------------------------------------------


def bench_gemm(name: str, n: int, k: int, args) -> list[str]:
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    rows = []
    for sym in (True, False):
        int4 = to_int4(weight, sym)
        dense = dequantize(int4, torch.bfloat16)
        dense_copies = [
            clone(dense) for _ in range(copies_for(tensor_bytes(dense), args.calls))
        ]
        int4_copies = [
            clone(int4) for _ in range(copies_for(tensor_bytes(int4), args.calls))
        ]
        for m in GEMM_ROWS if sym else (1, 16, 512):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            error = relative_error(
                int4_gemm(x, int4.qweight, int4.scales, int4.qzeros), F.linear(x, dense)
            )

            bf16 = graph_time(
                cycled(functools.partial(F.linear, x), dense_copies, args.calls),
                args.repeats,
            )
            size = "small" if m <= 16 else "medium" if m <= 64 else "large"
            configs = [tile_config(m), *CANDIDATES[size]]
            times = [
                graph_time(
                    cycled(
                        lambda w, x=x, c=c: int4_gemm(
                            x, w.qweight, w.scales, w.qzeros, c
                        ),
                        int4_copies,
                        args.calls,
                    ),
                    args.repeats,
                )
                for c in configs
            ]
            best = min(range(len(configs)), key=times.__getitem__)
            c = configs[best]
            rows.append(
                f"| {name} {n}x{k} | {'sym' if sym else 'asym'} | {m} | {bf16 * 1e6:.1f} | "
                f"{times[0] * 1e6:.1f} | {bf16 / times[0]:.2f}x | "
                f"{times[best] * 1e6:.1f} ({c.block_m},{c.block_n},{c.block_k},w{c.num_warps},s{c.num_stages}) | "
                f"{bf16 / times[best]:.2f}x | {error:.1e} |"
            )
            print(rows[-1], flush=True)
    return rows


# -- routed FFN layer -------------------------------------------------------------


def ffn_weights(hidden: int, inter: int, rank: int, router: int) -> RoutedFFNWeights:
    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        t = torch.randn(*shape, device="cuda") * scale / shape[-1] ** 0.5
        return t.to(dtype)

    return RoutedFFNWeights(
        fc1_weight=randn(router, hidden, dtype=torch.float32, scale=2.0),
        fc1_bias=randn(router, dtype=torch.float32),
        fc2_weight=randn(1, router, dtype=torch.float32, scale=4.0),
        fc2_bias=torch.zeros(1, device="cuda"),
        gate_up=randn(2 * inter, hidden),
        down=randn(hidden, inter),
        light_down=randn(rank, hidden),
        light_up=randn(hidden, rank),
    )


def dense_ffn(u: torch.Tensor, w: RoutedFFNWeights) -> torch.Tensor:
    gate, up = F.linear(u, w.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down)


def weight_copies(w: RoutedFFNWeights, calls: int) -> list[RoutedFFNWeights]:
    nbytes = tensor_bytes(w.gate_up) + tensor_bytes(w.down)
    return [
        RoutedFFNWeights(**{f: v.clone() for f, v in vars(w).items()})
        for _ in range(copies_for(nbytes, calls))
    ]


def routed_time(u: torch.Tensor, weights, threshold: float, args) -> float:
    return graph_time(
        cycled(lambda w: routed_ffn_triton(u, w, threshold), weights, args.calls),
        args.repeats,
    )


def bench_ffn(name: str, args) -> list[str]:
    base = ffn_weights(*FFN_SHAPES[name])
    weights = weight_copies(base, args.calls)
    hidden = FFN_SHAPES[name][0]
    rows = []
    for T in TOKENS:
        # T = 1: one token is heavy or light; the fractions are a mix of the two.
        u = torch.randn(max(T, 2), hidden, device="cuda", dtype=torch.bfloat16)[:T]
        scores = router_scores_torch(
            u, base.fc1_weight, base.fc1_bias, base.fc2_weight, base.fc2_bias
        )
        dense = graph_time(
            cycled(functools.partial(dense_ffn, u), weights, args.calls), args.repeats
        )
        counts = [0, 1] if T == 1 else [round(f * T) for f in FRACTIONS]
        measured = {}
        for count in counts:
            threshold = threshold_for(scores, count)
            y, _, bounds = routed_ffn_triton(u, base, threshold)
            assert int(bounds[0]) == count, (int(bounds[0]), count)
            if count == T:
                error = relative_error(y, dense_ffn(u, base))
            measured[count] = routed_time(u, weights, threshold, args)
        for fraction in FRACTIONS:
            if T == 1:
                routed = fraction * measured[1] + (1 - fraction) * measured[0]
            else:
                routed = measured[round(fraction * T)]
            rows.append(
                f"| {name} | {T} | {fraction:.0%} | {dense * 1e6:.1f} | "
                f"{routed * 1e6:.1f} | {routed / dense:.2f} |"
            )
            print(rows[-1], flush=True)
        if T > 1:
            rows.append(
                f"| {name} | {T} | all heavy: rel. error vs dense | | {error:.1e} | |"
            )
        else:
            rows.append(
                f"| {name} | 1 | light / heavy token | | | {measured[0] / measured[1]:.2f} |"
            )
    return rows


# Tiles tried for the heavy GEMMs at prefill sizes: (gather with SwiGLU, scatter).
TILE_CANDIDATES = [
    (Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3)),  # tiles_for's choice
    (Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)),
    (Tiles(64, 128, 4, 3), Tiles(64, 128, 4, 3)),
    (Tiles(128, 128, 8, 3), Tiles(128, 256, 8, 3)),
    (Tiles(128, 64, 4, 4), Tiles(128, 128, 4, 4)),
    (Tiles(64, 64, 4, 4), Tiles(128, 64, 4, 4)),
]


def bench_tiles(args) -> list[str]:
    """The routed FFN at T = 512, 50 % heavy, per tile candidate."""
    rows = []
    for name in FFN_SHAPES:
        base = ffn_weights(*FFN_SHAPES[name])
        weights = weight_copies(base, args.calls)
        u = torch.randn(512, FFN_SHAPES[name][0], device="cuda", dtype=torch.bfloat16)
        scores = router_scores_torch(
            u, base.fc1_weight, base.fc1_bias, base.fc2_weight, base.fc2_bias
        )
        threshold = threshold_for(scores, 256)
        dense = graph_time(
            cycled(functools.partial(dense_ffn, u), weights, args.calls), args.repeats
        )
        want, _, _ = routed_ffn_triton(u, base, threshold)
        chosen = routed_gemm.tiles_for
        for gather_tiles, scatter_tiles in TILE_CANDIDATES:
            routed_gemm.tiles_for = (
                lambda rows, swiglu=False, g=gather_tiles, s=scatter_tiles: (
                    g if swiglu else s
                )
            )
            try:
                y, _, _ = routed_ffn_triton(u, base, threshold)
                error = relative_error(y, want)
                t = routed_time(u, weights, threshold, args)
                rows.append(
                    f"| {name} | {tuple(gather_tiles)} | {tuple(scatter_tiles)} | "
                    f"{t * 1e6:.1f} | {t / dense:.2f} | {error:.1e} |"
                )
            except Exception as e:  # a tile the GPU cannot take: say so, go on
                rows.append(
                    f"| {name} | {tuple(gather_tiles)} | {tuple(scatter_tiles)} | failed: {type(e).__name__} | | |"
                )
            finally:
                routed_gemm.tiles_for = chosen
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument(
        "--parts", nargs="+", default=["ffn", "gemm"], choices=["ffn", "gemm", "tiles"]
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    sections = []
    if "ffn" in args.parts:
        rows = [
            row
            for name in tqdm(FFN_SHAPES, desc="routed FFN")
            for row in bench_ffn(name, args)
        ]
        shapes = ", ".join(f"{n}: hidden {h}, FFN {i}, light rank {r}, router {R}"
                           for n, (h, i, r, R) in FFN_SHAPES.items())  # fmt: skip
        sections.append(
            "## Routed FFN layer vs dense FFN\n\n"
            f"bf16; shapes {shapes}. Dense = cuBLAS gate_up, SiLU * up, cuBLAS down (torch). "
            "Routed = `routed_ffn_triton`: router GEMM (float32, cuBLAS), one routing "
            "kernel (router head, routes, heavy-row list), Triton gather GEMM + SwiGLU and "
            "scatter GEMM on the heavy rows, light path by cuBLAS on every row, one combine "
            "kernel. T = 1: a token is heavy or light; a fraction is the mix of the two "
            "timings.\n\n"
            "| shape | T | heavy | dense FFN us | routed us | routed / dense |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows)
        )
    if "gemm" in args.parts:
        shapes = {f"{name} {proj}": dims for name, (h, i, _, _) in FFN_SHAPES.items()
                  for proj, dims in (("gate_up", (2 * i, h)), ("down", (h, i)))}  # fmt: skip
        rows = [
            row
            for name, (n, k) in tqdm(shapes.items(), desc="W4A16")
            for row in bench_gemm(name, n, k, args)
        ]
        sections.append(
            "## W4A16 GEMM (Triton, `int4_gemm`) vs bf16 GEMM (cuBLAS, `F.linear`)\n\n"
            f"Group {GROUP_SIZE}. `default` = the tiles `tile_config` picks; `best` = the "
            "fastest of the default and the candidates tried in the same run (block M, N, K, "
            "warps, stages). Error = relative L2 error vs cuBLAS on the dequantized weight.\n\n"
            "| weight N x K | zeros | M | bf16 us | INT4 default us | speed-up | INT4 best us (tiles) | speed-up | error |\n"
            "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
        )
    if "tiles" in args.parts:
        rows = bench_tiles(args)
        sections.append(
            "## Heavy-GEMM tiles at T = 512, 50 % heavy\n\n"
            "(block M, block N, warps, stages) of the gather GEMM (SwiGLU) and the scatter "
            "GEMM; the first row is `tiles_for`'s choice. Error = relative L2 difference "
            "from the first row's output.\n\n"
            "| shape | gather tiles | scatter tiles | routed us | routed / dense | error |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows)
        )
    body = "\n\n".join(sections)
    print(body)
    print(
        f"written to {write_report('bench_gpu_kernels', 'Triton kernels on a GPU', body)}"
    )


if __name__ == "__main__":
    main()
