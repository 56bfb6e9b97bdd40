"""The `vllm-o3` command: make and transform O3 checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")


def add_create_parser(commands: argparse._SubParsersAction) -> None:
    from vllm_o3.tools.create import PRESETS

    parser = commands.add_parser(
        "create",
        help="write a randomly initialised O3 checkpoint (tests, benchmarks)",
        description="Write a randomly initialised, valid O3 checkpoint folder: "
        "config.json, model.safetensors, tokenizer and generation config.",
    )
    parser.add_argument("out", type=Path, help="checkpoint folder to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument(
        "--attn-output-gate",
        action="store_true",
        help="add the per-head attention gate",
    )
    parser.add_argument(
        "--router-threshold", type=float, default=None, help="default: the spec's 0.85"
    )
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--force", action="store_true", help="replace OUT if it exists"
    )
    existing.add_argument(
        "--exist-ok", action="store_true", help="leave an existing OUT as it is"
    )
    parser.set_defaults(run=run_create)


def run_create(args: argparse.Namespace) -> None:
    import torch

    from vllm_o3.tools.create import create_checkpoint

    if args.exist_ok and (args.out / "config.json").exists():
        print(f"{args.out} exists; keeping it")
        return
    overrides = {"attn_output_gate": args.attn_output_gate}
    if args.router_threshold is not None:
        overrides["router_threshold"] = args.router_threshold
    path = create_checkpoint(
        args.out,
        preset=args.preset,
        seed=args.seed,
        dtype=getattr(torch, args.dtype),
        overwrite=args.force,
        **overrides,
    )
    print(f"wrote O3 checkpoint ({args.preset}) to {path}")


def add_quantize_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "quantize",
        help="write an o3_int4 copy of a 16-bit O3 checkpoint",
        description="Quantize the FFN projections of a 16-bit O3 checkpoint to "
        "INT4 (round-to-nearest per group, GPTQ-style tensors; O3_SPEC section "
        "4); every other tensor and file is copied.",
    )
    parser.add_argument("src", type=Path, help="16-bit O3 checkpoint folder")
    parser.add_argument("out", type=Path, help="folder to write")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=128)
    symmetry = parser.add_mutually_exclusive_group()
    symmetry.add_argument(
        "--sym", dest="sym", action="store_true", default=True,
        help="symmetric, implicit zero point 8 (default)",
    )  # fmt: skip
    symmetry.add_argument(
        "--asym",
        dest="sym",
        action="store_false",
        help="asymmetric, explicit zero points",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.set_defaults(run=run_quantize)


def run_quantize(args: argparse.Namespace) -> None:
    from vllm_o3.tools.quantize import quantize_checkpoint

    path = quantize_checkpoint(
        args.src, args.out, args.group_size, args.sym, overwrite=args.force
    )
    kind = "symmetric" if args.sym else "asymmetric"
    print(f"wrote o3_int4 checkpoint (group {args.group_size}, {kind}) to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-o3", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    add_create_parser(commands)
    add_quantize_parser(commands)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (FileExistsError, ValueError) as e:
        sys.exit(f"vllm-o3: error: {e}")


if __name__ == "__main__":
    main()
