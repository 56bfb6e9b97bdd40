"""Quality of a converted O3 model on held-out text of four domains (documents
the converter never saw), against its parent and random routing.

For a range of router thresholds (each a different share of tokens on the full
FFN in the routed layers): perplexity per domain, the heavy fraction reached,
the FFN FLOPs saved, and perplexity with random routing at the same per-layer
fractions. The converter's own sweeps (on held-out calibration text; fitted
only and after training) are plotted beside them. Writes
docs/conversion_quality.md and docs/conversion_quality.png.

    python -m benchmarks.conversion_quality MODEL [--windows 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import DOCS, write_report
from vllm_o3.tools.corpora import load_corpora
from vllm_o3.tools.evaluate import (
    ffn_flops_saved,
    random_routing,
    reference_perplexity,
    text_windows,
)

THRESHOLDS = (0.97, 0.93, 0.85, 0.75, 0.6, 0.45)


def main() -> None:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument(
        "--windows", type=int, default=4, help="512-token windows per domain"
    )
    parser.add_argument(
        "--trained",
        type=Path,
        help="a conversion of the same parent with --train-minutes, whose "
        "converter sweep after training is plotted beside",
    )
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    config = model.config
    report = config.o3_conversion
    corpora = load_corpora()
    windows = {
        d: text_windows(tokenizer, "\n\n".join(c.held_out), args.windows)
        for d, c in corpora.items()
    }
    domains = list(windows)
    config.router_threshold = 0.0
    parent = {d: reference_perplexity(model, w)[0] for d, w in windows.items()}
    rows = []
    for threshold in tqdm(THRESHOLDS, desc="thresholds"):
        config.router_threshold = threshold
        ppl, heavy = {}, {}
        for d, w in windows.items():
            ppl[d], layer_heavy = reference_perplexity(model, w)
            for i, h in layer_heavy.items():
                heavy[i] = heavy.get(i, 0.0) + h / len(windows)
        with random_routing(model, heavy):
            random = {d: reference_perplexity(model, w)[0] for d, w in windows.items()}
        rows.append(
            {"threshold": threshold, "heavy": sum(heavy.values()) / max(1, len(heavy)),
             "saved": ffn_flops_saved(config, heavy), "ppl": ppl, "random": random}
        )  # fmt: skip
    config.router_threshold = 0.85
    trained = None
    if args.trained is not None:
        trained = json.loads((args.trained / "config.json").read_text())[
            "o3_conversion"
        ]
    plot_path = plot(rows, parent, report, trained, domains)
    target = report["operating_point"]["heavy_fraction"]
    lines = [
        f"Converted by `{report.get('command', 'vllm-o3 convert')}` from `{report['parent']}`: "
        f"routed layers {report['operating_point']['routed_layers']} at a calibrated heavy "
        f"fraction of {target:.0%} (layers kept dense and why: {report['dense_layers']}). "
        f"Conversion cost {report['cpu_minutes']} CPU minutes ({report['wall_minutes']} min "
        f"wall); training: {json.dumps(report['training'])}.",
        "",
        f"Held-out text ({args.windows} windows of 512 tokens per domain, documents not used "
        "for calibration): Austen's Pride and Prejudice and Sense and Sensibility (prose), "
        "a third of the Reuters articles (news), a third of CPython's pydoc topics "
        "(docs), a third of the selected stdlib modules (code).",
        "",
        "| router_threshold | heavy fraction | FFN FLOPs saved | "
        + " | ".join(f"{d} ppl (+%)" for d in domains)
        + " | random routing, worst +% |",
        "|---|---|---|" + "---|" * len(domains) + "---|",
        "| 0 (parent) | 100% | 0% | "
        + " | ".join(f"{parent[d]:.2f}" for d in domains)
        + " | |",
    ]
    for row in rows:
        increases = {d: row["ppl"][d] / parent[d] - 1 for d in domains}
        worst_random = max(row["random"][d] / parent[d] - 1 for d in domains)
        mark = " (served)" if row["threshold"] == 0.85 else ""
        lines.append(
            f"| {row['threshold']}{mark} | {row['heavy']:.1%} | {row['saved']:.1%} | "
            + " | ".join(f"{row['ppl'][d]:.2f} ({increases[d]:+.1%})" for d in domains)
            + f" | {worst_random:+.1%} |"
        )
    lines += [
        "",
        f"Heavy fraction reached on held-out text at the served threshold vs the "
        f"calibration target {target:.0%}: "
        f"{next(r['heavy'] for r in rows if r['threshold'] == 0.85):.1%}.",
        "",
        f"![perplexity increase vs FFN FLOPs saved]({plot_path.name})",
        "",
        "The converter's own sweeps on the dev windows of the calibration text "
        "(`o3_conversion` in config.json), fitted only (squares) and after training "
        "(triangles, this model's or `--trained`'s), are plotted beside the held-out "
        "curves; the served point came from the converter's sweep.",
    ]
    print("\n".join(lines))
    title = "Converted SmolLM2-135M-Instruct: quality against FFN savings"
    print(
        f"written to {write_report('conversion_quality', title, chr(10).join(lines))}"
    )


def plot(rows, parent, report, trained, domains) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def worst(ppl, base):
        return 100 * max(ppl[d] / base[d] - 1 for d in domains if d in ppl)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    recipe = "fitted only" if report.get("training") is None else "trained"
    ax.plot([100 * r["saved"] for r in rows], [worst(r["ppl"], parent) for r in rows],
            marker="o", label=f"this model ({recipe}), held-out text")  # fmt: skip
    ax.plot([100 * r["saved"] for r in rows], [worst(r["random"], parent) for r in rows],
            marker="x", linestyle="--", label="random routing, same fractions")  # fmt: skip
    sweeps = [(report["sweep_fitted_only"], "s", "fitted only (converter sweep)")]
    for conversion in (report, trained):
        if conversion is not None and conversion.get("training") is not None:
            minutes = conversion["training"]["minutes"]
            label = f"after {minutes:g} min of training (converter sweep)"
            sweeps.append((conversion["sweep"], "^", label))
    for points, marker, label in sweeps:
        ax.scatter([100 * p["flops_saved"] for p in points],
                   [100 * max(p["ppl_increase"].values()) for p in points],
                   marker=marker, alpha=0.6, label=label)  # fmt: skip
    ax.axhline(10, color="grey", linestyle=":", label="10 % budget")
    ax.set_xlabel("FFN FLOPs saved (%)")
    ax.set_ylabel("perplexity increase, worst domain (%)")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_ylim(bottom=-1)  # a point can gain a little; none gains 10 %
    ax.set_xlim(left=0)
    ax.set_title("Quality vs savings")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = DOCS / "conversion_quality.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
