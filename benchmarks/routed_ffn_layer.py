"""One routed layer's FFN against the dense FFN, at heavy fractions 0-100 %.

Builds vLLM's own layers (LlamaMLP, O3's router and light path) with their CPU
weight packing, and times the routed FFN op body (router + compaction + both
paths) as the engine runs it on this CPU (`cpu_routed_ffn`) and in PyTorch,
against the dense FFN on the same input, side by side, medians of repeats. At
T = 1 a token is either heavy or light, so a fraction there is the mean over a
sequence of single-token calls in which that share of tokens is heavy.

    python -m benchmarks.routed_ffn_layer [--repeats 20] [--shapes tinyllama smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm import tqdm

from benchmarks.common import median_time, single_process_vllm, write_report

SHAPES = {  # hidden, intermediate, light_rank, router_hidden
    "tinyllama": (2048, 5632, 256, 64),
    "smollm2": (576, 1536, 72, 64),
}
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
TOKENS = (1, 16, 512)


def build_layers(hidden: int, intermediate: int, light_rank: int, router_hidden: int):
    from vllm.model_executor.models.llama import LlamaMLP

    from vllm_o3.model.vllm_model import O3LightPath, O3Router

    torch.manual_seed(0)
    mlp = LlamaMLP(hidden, intermediate, "silu", prefix="mlp")
    light = O3LightPath(hidden, light_rank)
    router = O3Router(hidden, router_hidden)
    for module in (mlp, light, router):
        for param in module.parameters():
            param.data.normal_(0, param.shape[-1] ** -0.5)
        for sub in module.modules():
            method = getattr(sub, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(sub)  # CPU GEMM packing
    light.use_cpu_gemm()  # as the engine's O3 layers do
    return mlp, light, router


def threshold_for(scores: torch.Tensor, num_heavy: int) -> float:
    """A threshold that sends exactly the `num_heavy` best-scoring rows heavy,
    midway between two scores (a kernel's scores may differ in the last bit)."""
    ranked = scores.sort(descending=True).values.tolist()
    if num_heavy == 0:
        return 2.0
    if num_heavy == len(ranked):
        return ranked[-1] / 2
    return (ranked[num_heavy - 1] + ranked[num_heavy]) / 2


def per_row_time(fn, rows: torch.Tensor, repeats: int) -> float:
    """Median over repeats of the mean time of `fn` on each single row."""
    fn(rows[:1])
    samples = []
    for _ in range(max(3, repeats // 5)):
        start = time.perf_counter()
        for row in rows.split(1):
            fn(row)
        samples.append((time.perf_counter() - start) / len(rows))
    return statistics.median(samples)


def bench_shape(name: str, repeats: int) -> list[str]:
    from vllm_o3.kernels import cpu_routed_ffn
    from vllm_o3.kernels.routing import routed_ffn_torch

    mlp, light, router = build_layers(*SHAPES[name])
    hidden = SHAPES[name][0]
    reason = cpu_routed_ffn.unavailable_reason(torch.bfloat16, hidden)
    if reason is not None:
        raise SystemExit(f"the CPU routed FFN kernel cannot run here: {reason}")
    mlp.act_fn = cpu_routed_ffn.CpuSiluAndMul()  # as the engine's routed layers
    packed = cpu_routed_ffn.pack_routed_weights(
        router.fc1.weight,
        router.fc1.bias,
        router.fc2.weight,
        router.fc2.bias,
        light.down.weight,
        light.up.weight,
    )
    variants = {
        "kernel": lambda u, t: cpu_routed_ffn.routed_ffn_cpu(u, packed, t, mlp, light),
        "pytorch": lambda u, t: routed_ffn_torch(u, router(u), t, mlp, light),
    }
    rows = []
    progress = tqdm(total=len(TOKENS) * len(FRACTIONS), desc=name)
    for T in TOKENS:
        if T == 1:
            u_all = torch.randn(200, hidden, dtype=torch.bfloat16)
            scores_all = router(u_all)
            dense = per_row_time(lambda row: mlp(row), u_all, repeats)
        else:
            u = torch.randn(T, hidden, dtype=torch.bfloat16)
            scores = router(u)
            dense = median_time(lambda u=u: mlp(u), repeats)
        for fraction in FRACTIONS:
            times = {}
            for variant, routed in variants.items():
                if T == 1:
                    threshold = threshold_for(scores_all, round(fraction * len(u_all)))
                    times[variant] = per_row_time(
                        lambda row, t=threshold, routed=routed: routed(row, t),
                        u_all,
                        repeats,
                    )
                else:
                    threshold = threshold_for(scores, round(fraction * T))
                    times[variant] = median_time(
                        lambda u=u, t=threshold, routed=routed: routed(u, t), repeats
                    )
            rows.append(
                f"| {name} | {T} | {fraction:.0%} | {times['kernel'] * 1e3:.3f} | "
                f"{times['pytorch'] * 1e3:.3f} | {dense * 1e3:.3f} | "
                f"{times['kernel'] / dense:.2f} |"
            )
            progress.update()
    progress.close()
    return rows


def kernel_paths() -> str:
    """What `cpu_routed_ffn` runs in C++ on this CPU."""
    from vllm_o3.kernels import cpu_routed_ffn

    isa = torch.ops.o3_cpu.kernel_isa()
    rows = cpu_routed_ffn.fused_rows_below()
    if rows == sys.maxsize:
        return f"the router and the light path in C++ ({isa}) at every row count"
    return (
        f"the router in C++ ({isa}); below {rows} rows the light path too, in "
        f"the same call, from {rows} rows the light rows through vLLM's CPU GEMM"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    args = parser.parse_args()
    torch.set_default_dtype(torch.bfloat16)
    with single_process_vllm():
        rows = [row for name in args.shapes for row in bench_shape(name, args.repeats)]
    table = "\n".join(
        [
            "| shape | T | heavy | routed FFN ms | routed in PyTorch ms | "
            "dense FFN ms | routed / dense |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    shapes = ", ".join(
        f"{n}: hidden {h}, FFN {i}, light rank {r}, router {R}"
        for n, (h, i, r, R) in SHAPES.items()
        if n in args.shapes
    )
    body = (
        f"bf16, vLLM 0.32 CPU layers with their oneDNN packing. Shapes: {shapes}. "
        "Routed = router + compaction + full FFN on heavy rows + light path on "
        f"the rest: as the engine runs it on this CPU (`cpu_routed_ffn`: "
        f"{kernel_paths()}), and in PyTorch "
        "(`routed_ffn_torch`, what runs where the C++ kernel cannot); medians "
        "of repeats (T = 1: "
        "mean per call over 200 single-token calls with that share heavy, the dense FFN timed the same "
        "way).\n\n" + table
    )
    print(body)
    print(
        f"written to {write_report('bench_routed_ffn_layer', 'Routed FFN layer vs dense FFN', body)}"
    )


if __name__ == "__main__":
    main()
