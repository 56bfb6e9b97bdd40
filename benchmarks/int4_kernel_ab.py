"""The CPU INT4 GEMM of this checkout against the same kernel at another git
revision, and both against the 16-bit linear, in one process.

On a shared machine whose speed drifts by 2-3x from one minute to the next,
two benchmark runs cannot tell a 10 % change in a kernel. Here the base
revision's `csrc/` is built as a second library (its operations renamed
from `o3_cpu` to `o3_base`), and every repeat calls 16-bit, base and this
checkout back to back on the same input, the caches evicted before each call
(as `benchmarks.int4_linear`). It reports medians of the times and, per
repeat, the ratios of the three: the drift cancels in those. The two must
share `int4_gemm`'s signature and weight layout (`pack_for_gemm`); a row
whose outputs differ between the two says so. On CPUs without AVX512-BF16
the base must have the AVX2 build (0a6201e on): older ones run AVX-512
code. `--ffn` times each preset's whole FFN instead (gate_up, vLLM's
`SiluAndMul`, down): a kernel change that only moves cost onto the next
operation (how it leaves y in the caches) shows there and not on one
linear.

    python -m benchmarks.int4_kernel_ab --base HEAD~1 [--rows 64,512] [--repeats 9] [--ffn]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import (
    cache_evictor,
    interleaved_times,
    median_ratio,
    single_process_vllm,
    write_report,
)
from benchmarks.int4_linear import SHAPES, dense_linear

CSRC = "vllm_o3/kernels/csrc"
CACHE = Path(__file__).resolve().parent.parent / ".cache" / "int4_kernel_ab"


def build_base(revision: str) -> str:
    """Build `revision`'s CPU kernels as `torch.ops.o3_base`; returns the
    commit it resolved to."""
    from torch.utils.cpp_extension import load

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], check=True, capture_output=True, text=True
        ).stdout

    commit = git("rev-parse", "--short", revision).strip()
    source = CACHE / commit
    source.mkdir(parents=True, exist_ok=True)
    for name in git("ls-tree", "--name-only", f"{commit}:{CSRC}").split():
        text = git("show", f"{commit}:{CSRC}/{name}")
        (source / name).write_text(text.replace("o3_cpu", "o3_base"))
    load(
        name=f"o3_base_{commit}",
        sources=[str(path) for path in sorted(source.glob("*.cpp"))],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        build_directory=str(source),
    )
    return commit


Variants = tuple[Callable[[torch.Tensor], torch.Tensor], ...]


def linear_variants(name: str, asym: bool) -> Variants:
    """16-bit, base and this checkout's INT4 GEMM for `SHAPES[name]`."""
    from vllm_o3.kernels import cpu_int4_gemm
    from vllm_o3.kernels.int4_linear import Int4Linear
    from vllm_o3.quantization.int4_format import largest_group_size, quantize

    out_features, in_features = SHAPES[name]
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * in_features**-0.5
    packed = quantize(weight, largest_group_size(name, in_features), sym=not asym)
    linear = Int4Linear(packed, torch.bfloat16)
    kernel_args = (
        linear.words,
        linear.block_scales,
        linear.block_offsets,
        out_features,
        cpu_int4_gemm.AMX_MIN_ROWS,
    )
    return (
        dense_linear(weight, packed),
        lambda x: torch.ops.o3_base.int4_gemm(x, *kernel_args),
        lambda x: torch.ops.o3_cpu.int4_gemm(x, *kernel_args),
    )


def ffn_variants(model: str, asym: bool) -> Variants:
    """`linear_variants` of the preset's gate_up and down, each with vLLM's
    SiluAndMul between them."""
    from vllm.model_executor.layers.activation import SiluAndMul

    act = SiluAndMul()
    gate_up = linear_variants(f"{model} gate_up", asym)
    down = linear_variants(f"{model} down", asym)
    return tuple(
        lambda x, g=g, d=d: d(act(g(x))) for g, d in zip(gate_up, down, strict=True)
    )


def main() -> None:
    from vllm_o3.kernels import cpu_int4_gemm

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare with")
    parser.add_argument("--rows", default="64,128,256,512")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--asym", action="store_true", help="asymmetric weights")
    parser.add_argument(
        "--ffn", action="store_true", help="each preset's FFN instead of its linears"
    )
    args = parser.parse_args()
    reason = cpu_int4_gemm.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the CPU INT4 GEMM does not run here: {reason}")
    commit = build_base(args.base)
    torch.set_default_dtype(torch.bfloat16)
    evict = cache_evictor()
    lines = []
    with single_process_vllm():
        if args.ffn:
            cases = {  # label: (inputs, variants)
                f"{model} FFN": (
                    SHAPES[f"{model} gate_up"][1],
                    ffn_variants(model, args.asym),
                )
                for model in ("1b", "135m")
            }
        else:
            cases = {
                f"{name} {out_features}x{in_features}": (
                    in_features,
                    linear_variants(name, args.asym),
                )
                for name, (out_features, in_features) in SHAPES.items()
            }
        for label, (in_features, variants) in cases.items():
            for rows in tqdm([int(r) for r in args.rows.split(",")], desc=label):
                x = torch.randn(rows, in_features)
                same = torch.equal(variants[1](x), variants[2](x))
                times = interleaved_times(
                    [lambda f=f, x=x: f(x) for f in variants],
                    args.repeats,
                    before=evict,
                )
                ms = " | ".join(f"{statistics.median(t) * 1e3:.3f}" for t in times)
                lines.append(
                    f"| {label} | {rows}{'' if same else ' (outputs differ)'} | {ms} "
                    f"| {median_ratio(times[0], times[1]):.2f}x "
                    f"| {median_ratio(times[0], times[2]):.2f}x "
                    f"| **{median_ratio(times[1], times[2]):.2f}x** |"
                )
    body = (
        f"Base: {commit}; INT4 {'asymmetric' if args.asym else 'symmetric'}, "
        "group 128 (64 where 128 does not divide the input), bf16 activations; "
        "the caches evicted before each call. Times are medians; ratios are "
        "medians over the repeats of each repeat's ratio.\n\n"
        f"| {'FFN' if args.ffn else 'linear'} | rows | 16-bit ms | base ms "
        "| this ms | base vs 16-bit | this vs 16-bit | this vs base |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines)
    )
    print(body)
    path = write_report(
        "bench_int4_kernel_ab", "CPU INT4 GEMM: A/B of two revisions", body
    )
    print(f"written to {path}")


if __name__ == "__main__":
    main()
